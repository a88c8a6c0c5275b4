"""The decoder-only language model (Flax NNX). Knows logical axis names, never devices."""
from models.config import ModelConfig
from models.llama import Transformer
