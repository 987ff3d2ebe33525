# SPDX-License-Identifier: Apache-2.0
"""MLA latent caches upcycled from pretrained GQA/MHA attention (X-EcoMLA): rewrite, attention, I/O, accounting."""

from kvexport.mla.attention import MLAAttention, latent_attention
from kvexport.mla.config import MLALayerPlan, MLASettings, max_kv_rank
from kvexport.mla.io import is_mla_dir, load_mla, save_mla
from kvexport.mla.rewrite import rewrite_to_mla, set_absorb

__all__ = ["MLAAttention", "latent_attention", "MLALayerPlan", "MLASettings", "max_kv_rank", "is_mla_dir",
           "load_mla", "save_mla", "rewrite_to_mla", "set_absorb"]
