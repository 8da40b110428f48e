"""Command-line tools on top of the engine: the `megatron-sft-engine` console command
(tools/cli.py), checkpoint conversion (tools/convert.py), the benchmarks (the tools/bench/
package, `python -m tools.bench`), and the local tiny models, tokenizers and data of the demos
and tests (tools/tiny_models.py, tools/char_tokenizer.py, tools/demo.py). Imports flow tools ->
engine -> models -> parallel; nothing here imports tests/.
"""
