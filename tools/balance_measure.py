"""balance_measure.py: measured per-rank times of the assignments mtrain.balance_batch predicts.

The command's entry point (docs/BALANCE.md, "Measured rank times (tool)"); the work is in the
package tools/balance_tool/ (balance_tool/usage.py: the method, as --help prints it). The names
below are re-exported for tests/python/test_balance_measure.py and other importers.

usage: python tools/balance_measure.py --budgets FILE --calibration FILE
       (--long-tail | --lengths FILE | --equal N --count C) --world R [--methods LIST]
       [--backend cpu|cuda] [--scale S] [--layers 0,15,31] [--json OUT] (see --help)
"""

from __future__ import annotations

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:  # loaded by path (importlib), not run as a script
    sys.path.insert(0, _HERE)

from balance_tool.assignment import Scales, assign, mass_curves  # noqa: E402
from balance_tool.budgets import (  # noqa: E402
    base_scale,
    derive_budgets,
    head_budgets,
    read_budgets,
    write_budgets,
)
from balance_tool.cli import METHODS, check_args, parser  # noqa: E402
from balance_tool.measure import run  # noqa: E402
from balance_tool.objectives import OBJECTIVES, shares  # noqa: E402
from balance_tool.objectives import loss as fit_loss  # noqa: E402
from balance_tool.pricing import (  # noqa: E402
    PairCounter,
    fit_calibration,
    fit_linear,
    linear_flops_per_token,
    predictor_pairs,
)
from balance_tool.report import _device_name, _stats  # noqa: E402
from balance_tool.runner import Runner, StructuredOptions, doc_seed, linear_seconds  # noqa: E402
from balance_tool.validate import validate  # noqa: E402
from balance_tool.workload import long_tail, read_lengths, scale_length  # noqa: E402

__all__ = [
    "METHODS",
    "OBJECTIVES",
    "PairCounter",
    "Runner",
    "Scales",
    "StructuredOptions",
    "_device_name",
    "_stats",
    "assign",
    "base_scale",
    "check_args",
    "derive_budgets",
    "doc_seed",
    "fit_calibration",
    "fit_linear",
    "fit_loss",
    "head_budgets",
    "linear_flops_per_token",
    "linear_seconds",
    "long_tail",
    "main",
    "mass_curves",
    "parser",
    "predictor_pairs",
    "read_budgets",
    "read_lengths",
    "run",
    "scale_length",
    "shares",
    "validate",
    "write_budgets",
]


def main() -> None:
    run()


if __name__ == "__main__":
    main()
