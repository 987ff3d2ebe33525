# SPDX-License-Identifier: Apache-2.0
"""kvexport: Hugging Face causal LMs with a KV cache of fixed, small size, exported for NVIDIA GPUs and Jetson."""

__version__ = "0.1.0"
