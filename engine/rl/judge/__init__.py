"""An LLM judge as a reward (reward.judge.*; docs/rl.md#an-llm-judge): each response, with its
prompt, goes to an OpenAI-compatible chat endpoint (any URL; `megatron-sft-engine serve` serves
one), the judge's reply is parsed into a float, and reward.judge.weight x that score joins the
response's score like a reward model's.

Modules (one job each):
    scorer     the judge's requests (concurrent, with timeouts and one deadline), the template
               and the parsers
    checks     the reward.judge.* keys, checked before any process group
    collector  the RL collector that adds the judge's scores, metrics and dump field

May import: engine.rl.collect, engine.rl.env (its package.module:name loader), engine.rl.rewards,
engine.errors.
"""
