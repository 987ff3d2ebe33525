# SPDX-License-Identifier: Apache-2.0
# Sourced by the example scripts: KVX_FAST=1 makes every `kvexport convert` quick (one short context, a few
# steps, one run each, no baseline export, no fidelity measurement) so that the test suite can run the
# examples as written (tests/docs/test_commands.py). Without it the examples use the full settings.
FAST=()
if [ "${KVX_FAST:-0}" = 1 ]; then
  FAST=(--contexts 256 --decode-steps 4 --validate-steps 4 --repeats 1 --no-baseline --no-fidelity)
fi
