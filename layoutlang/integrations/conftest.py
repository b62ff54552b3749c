"""pytest's doctest collection imports every module under layoutlang/: vllm_engine.py imports
vLLM, which only .venv-vllm has (tests/test_vllm.py runs it there)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_engine.py"]
