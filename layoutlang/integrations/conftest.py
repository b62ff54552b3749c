"""pytest's doctest collection imports every module under layoutlang/: vllm_engine.py imports
vLLM, which only .venv-vllm has (tests/test_vllm.py runs it there); verl.py imports verl, which .venv-vllm lacks."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_engine.py"]
if not importlib.util.find_spec("verl"):  # verl.py is verl's plug-in hook: it imports verl (.venv has it)
    collect_ignore.append("verl.py")
