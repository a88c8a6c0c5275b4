"""Experiment configs: one file per experiment, each `get_config(arg)` -> ml_collections.ConfigDict."""
