# SPDX-License-Identifier: Apache-2.0
from kvexport.cli import run

run()
