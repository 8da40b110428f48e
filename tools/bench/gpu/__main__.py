"""`python -m tools.bench.gpu` = `python -m tools.bench gpu` (tools.bench.gpu.cli)."""
from tools.bench.gpu.cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m tools.bench.gpu"))
