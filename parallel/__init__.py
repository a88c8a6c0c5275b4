"""Meshes and the tables that map logical axis names onto mesh axes. Knows devices, never the model."""
