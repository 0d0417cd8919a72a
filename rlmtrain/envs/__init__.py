"""Environments: the evidence-selection env over parsed PDFs, BookNavigator, code navigation.

Build one by name with `rlmtrain.envs.base.get_env(name, config)` (`DataConfig.env`). This
package file imports nothing on purpose: REPL workers import the `*_tools` modules inside it at
start-up, and those must pull in the standard library only.
"""
