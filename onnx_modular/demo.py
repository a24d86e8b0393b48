"""Small demo models for the command line, built from configs with random weights.

Each factory returns ``(model, args)`` as ``onnx-modular export`` expects:

    python -m onnx_modular export onnx_modular.demo:gpt2 -o gpt2.onnx

Nothing is downloaded; ``transformers`` must be installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import torch

__all__ = ["gpt2"]


def gpt2() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """A tiny GPT-2 (2 layers, width 64, 4 heads, vocabulary 100) and input ids of shape (2, 8).

    The weights are random (``torch.manual_seed(0)``), so the export is reproducible.

    Example::

        model, (input_ids,) = gpt2()
        hidden = model(input_ids).last_hidden_state   # (2, 8, 64)
    """
    try:
        import transformers
    except ImportError as e:  # transformers is optional for the package itself
        raise ImportError("The gpt2 demo needs transformers: pip install transformers") from e
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
