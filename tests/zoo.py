"""The model zoo: transformers models from configs with random weights (nothing downloaded).

Each entry builds ``(model, args, kwargs)`` and names the repeated layer class whose calls
the export must keep as functions, with how many calls there are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


def _ids(batch: int = 2, seq: int = 8, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


@dataclasses.dataclass
class ZooModel:
    build: Callable[[], tuple[torch.nn.Module, tuple, dict]]
    layer_class: str  # class name of the repeated layer
    layer_calls: int
    dynamic: bool = False  # export with dynamic batch and sequence too
    default: bool = False  # part of the default (CI) subset


def _mixtral():
    import transformers as T

    # transformers' default MoE path calls its own custom op (grouped_mm_fallback), which
    # has no ONNX translation; "batched_mm" is plain torch.
    config = T.MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             use_cache=False, experts_implementation="batched_mm")
    return T.MixtralModel(config), (_ids(),), {}


def _phi():
    import transformers as T

    config = T.PhiConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, use_cache=False)
    return T.PhiModel(config), (_ids(),), {}


def _gemma():
    import transformers as T

    config = T.GemmaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=8, use_cache=False)
    return T.GemmaModel(config), (_ids(),), {}


def _roberta():
    import transformers as T

    config = T.RobertaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=64)
    return T.RobertaModel(config), (_ids() + 3,), {}  # ids 0-2 are special (padding) in RoBERTa


def _bart():
    import transformers as T

    config = T.BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=64, use_cache=False)
    return T.BartModel(config), (), {"input_ids": _ids(), "decoder_input_ids": _ids(2, 5)}


def _resnet():
    import transformers as T

    config = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[2, 2], layer_type="basic")
    return T.ResNetModel(config), (torch.randn(2, 3, 32, 32),), {}


def _yolos():
    import transformers as T

    config = T.YolosConfig(image_size=[32, 32], patch_size=8, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_detection_tokens=4)
    return T.YolosModel(config), (torch.randn(2, 3, 32, 32),), {}


def _whisper():
    import transformers as T

    config = T.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                             decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
                             use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                             decoder_start_token_id=0)
    return T.WhisperModel(config), (), {"input_features": torch.randn(2, 8, 32), "decoder_input_ids": _ids(2, 4)}


def _wav2vec2():
    import transformers as T

    config = T.Wav2Vec2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                              num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    return T.Wav2Vec2Model(config), (torch.randn(2, 400),), {}


ZOO: dict[str, ZooModel] = {
    "mixtral": ZooModel(_mixtral, "MixtralDecoderLayer", 2, dynamic=True, default=True),
    "phi": ZooModel(_phi, "PhiDecoderLayer", 2, dynamic=True),
    "gemma": ZooModel(_gemma, "GemmaDecoderLayer", 2, dynamic=True),
    "roberta": ZooModel(_roberta, "RobertaLayer", 2),
    "bart": ZooModel(_bart, "BartEncoderLayer", 2, default=True),
    "resnet": ZooModel(_resnet, "ResNetBasicLayer", 4),
    "yolos": ZooModel(_yolos, "YolosLayer", 2),
    "whisper": ZooModel(_whisper, "WhisperEncoderLayer", 2, default=True),
    "wav2vec2": ZooModel(_wav2vec2, "Wav2Vec2EncoderLayer", 2),
}


def build(name: str):
    torch.manual_seed(0)
    model, args, kwargs = ZOO[name].build()
    return model.eval(), args, kwargs
