"""Rollouts: the asyncio scheduler that runs RLM trajectory trees over an inference engine.

`engine` holds the Engine contract, `batching` the continuous-batching loop the native and
simulated engines share, `engines/` the engines, `gate` the priority limits, `scheduler` the
trees, `metrics` what a rollout measured and `cli` the `rlmtrain rollout` command. Importing
this package loads none of them (the engines pull in torch or vLLM).
"""
