"""Small demo models for the command line, built from configs with random weights.

Each factory returns what ``onnx-modular export`` expects:

    python -m onnx_modular export onnx_modular.hf.demo:gpt2 -o gpt2.onnx
    python -m onnx_modular export onnx_modular.hf.demo:llama_kv -o llama_kv.onnx

Nothing is downloaded; ``transformers`` must be installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import torch

__all__ = ["gpt2", "llama_kv"]


def _transformers():
    try:
        import transformers
    except ImportError as e:  # transformers is optional for the package itself
        raise ImportError("The demos need transformers: pip install transformers") from e
    return transformers


def gpt2() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """A tiny GPT-2 (2 layers, width 64, 4 heads, vocabulary 100) and input ids of shape (2, 8).

    The weights are random (``torch.manual_seed(0)``), so the export is reproducible.

    Example::

        model, (input_ids,) = gpt2()
        hidden = model(input_ids).last_hidden_state   # (2, 8, 64)
    """
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=100,
        n_positions=32,
        use_cache=False,
        bos_token_id=99,
        eos_token_id=99,  # GPT-2's defaults (50256) lie outside this vocabulary
    )
    model = transformers.GPT2Model(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 8))
    return model, (input_ids,)


def llama_kv() -> dict:
    """A tiny Llama LM with a KV cache: a step after a prefill, cache and mask dynamic.

    Inputs: ``input_ids`` (2, 2), ``attention_mask`` (2, 5) and a 3-token ``DynamicCache``
    from a prefill; ``batch``, ``seq``, ``past`` and ``total`` (the mask length) are dynamic,
    so the file does the prefill (past 0) and every decode step.

    Example::

        spec = llama_kv()
        spec["model"](**spec["kwargs"]).logits.shape   # (2, 2, 100)
    """
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=True,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    from onnx_modular.hf.versions import cache_argument, returned_cache

    with torch.no_grad():
        cache = returned_cache(model(torch.randint(0, 100, (2, 3)), use_cache=True))
    cache_name = cache_argument(model)  # `cache` in transformers 5.24, `past_key_values` before
    kwargs = {
        "input_ids": torch.randint(0, 100, (2, 2)),  # dynamic sizes need example sizes >= 2
        "attention_mask": torch.ones(2, 5, dtype=torch.long),
        cache_name: cache,
    }
    Dim = torch.export.Dim
    batch, seq, past = Dim("batch"), Dim("seq"), Dim("past")
    dynamic_shapes = {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: Dim("total", min=4)},  # past + seq; torch assumes both >= 2
        cache_name: {0: batch, 2: past},
    }
    return {"model": model, "args": (), "kwargs": kwargs, "dynamic_shapes": dynamic_shapes}
