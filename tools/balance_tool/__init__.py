# The package behind tools/balance_measure.py (SparseBalance's measured rank times): one module
# per job; measure.run is the command, usage.TEXT its --help text (the method, step by step).
