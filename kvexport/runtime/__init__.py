# SPDX-License-Identifier: Apache-2.0
"""Running a cache: the step protocol (:mod:`.protocol`), the one loop and prefill driver (:mod:`.loop`), the
PyTorch driver (:mod:`.torch_driver`, imported from there: this package loads no torch), the one host of the graph
runtimes (:mod:`.host`) on onnxruntime (:mod:`.onnxruntime`, and the growing-past baseline :mod:`.growing`);
TensorRT's driver is :mod:`kvexport.tensorrt.generator`. onnxruntime is imported when a session is opened."""

from kvexport.runtime.growing import GrowingPast
from kvexport.runtime.host import GraphHost
from kvexport.runtime.loop import GenerationResult, Stream, check_prompt, decode_together, generate
from kvexport.runtime.onnxruntime import OrtGenerator, open_onnxruntime
from kvexport.runtime.protocol import Driver, StepDriver
from kvexport.runtime.sessions import OrtSessions
from kvexport.runtime.slots import SlotBank, SlotDriver

__all__ = ["GenerationResult", "Stream", "generate", "decode_together", "check_prompt", "StepDriver", "Driver",
           "GraphHost", "SlotBank", "SlotDriver", "OrtGenerator", "OrtSessions", "open_onnxruntime", "GrowingPast"]
