# SPDX-License-Identifier: Apache-2.0
# Included by llama.cpp's own CMakeLists right after its project() call (CMAKE_PROJECT_llama.cpp_INCLUDE), i.e. after
# llama-cpp-python has forced LLAMA_BUILD_COMMON on: the Python bindings load libllama and libggml* only, and the
# common utility library (about 1 MB of C++: chat templates, JSON, HTTP) is a third of the build that nothing here uses.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
