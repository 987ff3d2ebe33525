# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for the three TensorRT builder objects an optimization profile touches (no TensorRT here): they record
what :func:`kvexport.tensorrt.engine.capacity_profile` sets."""

from __future__ import annotations


class Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, lo, opt, hi):
        self.shapes[name] = (lo, opt, hi)


class Builder:
    def create_optimization_profile(self):
        return Profile()


class Config:
    def __init__(self):
        self.profiles = []

    def add_optimization_profile(self, p):
        self.profiles.append(p)
