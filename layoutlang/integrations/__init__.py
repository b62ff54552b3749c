"""Integrations with inference engines' own weight-update APIs (docs/engines.md).

- `layoutlang.integrations.vllm`: a vLLM weight-transfer backend named `layoutlang`,
  registered through the `vllm.general_plugins` entry point; its worker side
  (`vllm_engine.LayoutlangEngine`) takes a `TrainerJob`'s refit straight into the live
  parameters through an `EngineJob`.
- `layoutlang.integrations.sglang`: SGLang's `--custom-weight-loader`
  (`load_weights`), driven by control messages through `update_weights_from_tensor`,
  on the same engine-side checks (`live.py`).

Each imports its engine lazily: importing this package imports no engine.
"""
