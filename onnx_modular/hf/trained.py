"""Small decoders trained here, for quality measures and benches: deterministic, cached, no hub.

A byte-level decoder (vocabulary 256: token id = byte value) is trained on the text that ships
with Python (``pydoc_data.topics``, ~465k characters): the first 90% is the training text, the last
10% is held out (:func:`held_out_ids`). The checkpoint folder has what transformers and
onnxruntime-genai's builder need: ``config.json``, ``model.safetensors``, ``generation_config.json``
and a byte-level ``tokenizer.json`` (the ``tokenizers`` package) whose ids are the byte values.

Shapes: ``llama`` (LlamaForCausalLM), ``qwen3`` (q/k norms), ``phi3`` (packed qkv and gate/up).
Sizes: ``tiny`` (the tests: hidden 64, 2 layers, trained in seconds) and ``bench`` (hidden 192,
4 layers, a few minutes on 2 cores).

    folder = trained_checkpoint("llama", "bench")        # cached under ~/.cache/onnx_modular/trained
    ids = held_out_ids(count=8, length=128)             # [8, 128] int64, text the model never saw

Determinism: one seed, one torch thread during training, batches drawn from a numpy generator;
the cache key is the shape, the size and the training recipe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import numpy as np

from onnx_modular.errors import InvalidInputError

__all__ = ["TrainingRecipe", "RECIPES", "SHAPES", "trained_checkpoint", "text_ids", "held_out_ids",
           "calibration_ids", "write_byte_tokenizer", "VOCAB"]

#: Byte-level vocabulary: token id = byte value.
VOCAB = 256
#: Token ids the config names (bytes that never occur in the text).
BOS, EOS = 2, 3
#: The fraction of the text trained on; the rest is held out.
TRAIN_FRACTION = 0.9
SHAPES = ("llama", "qwen3", "phi3")


@dataclasses.dataclass(frozen=True)
class TrainingRecipe:
    """A model size and how long it trains."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    steps: int
    batch: int = 16
    sequence: int = 128
    learning_rate: float = 3e-3
    seed: int = 0


RECIPES = {
    "tiny": TrainingRecipe(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, steps=120, batch=8, sequence=64),
    "bench": TrainingRecipe(hidden=192, layers=4, heads=6, kv_heads=2, intermediate=512, steps=600),
}


def text_ids() -> np.ndarray:
    """The whole of ``pydoc_data.topics`` as byte ids (int64), in a fixed order (sorted topics)."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def _split() -> tuple[np.ndarray, np.ndarray]:
    ids = text_ids()
    cut = int(len(ids) * TRAIN_FRACTION)
    return ids[:cut], ids[cut:]


def _windows(ids: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    if count * length > len(ids):
        raise InvalidInputError(f"{count} windows of {length} tokens do not fit in {len(ids)} tokens.",
                                hint="Ask for fewer or shorter windows.")
    starts = np.random.default_rng(seed).permutation(len(ids) // length)[:count] * length
    return np.stack([ids[s:s + length] for s in starts]).astype(np.int64)


def held_out_ids(count: int = 8, length: int = 128, seed: int = 1) -> np.ndarray:
    """``[count, length]`` windows of the held-out text (never trained on)."""
    return _windows(_split()[1], count, length, seed)


def calibration_ids(count: int = 8, length: int = 128, seed: int = 2) -> np.ndarray:
    """``[count, length]`` windows of the training text (what a user calibrates on: their own data)."""
    return _windows(_split()[0], count, length, seed)


def _config(shape: str, recipe: TrainingRecipe):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
                  num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads, num_key_value_heads=recipe.kv_heads,
                  max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=False)
    if shape == "llama":
        return transformers.LlamaConfig(**common)
    if shape == "qwen3":
        return transformers.Qwen3Config(head_dim=recipe.hidden // recipe.heads, **common)
    if shape == "phi3":
        # the same original context: onnxruntime-genai's builder reads a longer one as LongRoPE (and wants its factors)
        return transformers.Phi3Config(original_max_position_embeddings=common["max_position_embeddings"], **common)
    raise InvalidInputError(f"trained_checkpoint: shape must be one of {', '.join(SHAPES)}, not {shape!r}.")


def _key(shape: str, recipe: TrainingRecipe) -> str:
    text = json.dumps({"shape": shape, **dataclasses.asdict(recipe), "text": TRAIN_FRACTION, "v": 1}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _train(shape: str, recipe: TrainingRecipe):
    import torch
    import transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums in the same order on every machine
    try:
        torch.manual_seed(recipe.seed)
        model = transformers.AutoModelForCausalLM.from_config(_config(shape, recipe), attn_implementation="eager")
        train, _ = _split()
        rng = np.random.default_rng(recipe.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=recipe.learning_rate, total_steps=recipe.steps,
                                                       pct_start=0.1)
        model.train()
        loss = None
        for _ in range(recipe.steps):
            starts = rng.integers(0, len(train) - recipe.sequence - 1, recipe.batch)
            batch = torch.from_numpy(np.stack([train[s:s + recipe.sequence] for s in starts]))
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        model.eval()
        return model, float(loss.detach()) if loss is not None else float("nan")
    finally:
        torch.set_num_threads(threads)


def write_byte_tokenizer(folder: str | os.PathLike) -> pathlib.Path:
    """A byte-level ``tokenizer.json`` (and ``tokenizer_config.json``) in ``folder``: id = byte value."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters byte-level tokenizers map bytes to
    mapping = _bytes_to_unicode()
    assert set(mapping.values()) == set(alphabet)
    vocab = {mapping[b]: b for b in range(VOCAB)}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    folder = pathlib.Path(folder)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": mapping[BOS], "eos_token": mapping[EOS],
        "pad_token": mapping[EOS], "model_max_length": 512, "clean_up_tokenization_spaces": False}))
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ``ByteLevel`` uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def default_cache() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ONNX_MODULAR_CACHE", pathlib.Path.home() / ".cache" / "onnx_modular")) / "trained"


def trained_checkpoint(shape: str = "llama", size: str = "bench", *, cache: str | os.PathLike | None = None,
                       recipe: TrainingRecipe | None = None) -> pathlib.Path:
    """The checkpoint folder of the ``shape`` decoder of ``size``, trained once and cached.

    Args:
        shape: ``llama``, ``qwen3`` or ``phi3``.
        size: ``tiny`` (tests, seconds) or ``bench`` (a few minutes on 2 cores).
        cache: The folder of trained checkpoints (default ``~/.cache/onnx_modular/trained``,
            or ``$ONNX_MODULAR_CACHE/trained``).
        recipe: Another size than :data:`RECIPES`' (``size`` then only names the folder).

    Returns:
        The folder (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``training.json``).
    """
    if recipe is None and size not in RECIPES:
        raise InvalidInputError(f"trained_checkpoint: size must be one of {', '.join(RECIPES)}, not {size!r}.")
    recipe = recipe or RECIPES[size]
    _config(shape, recipe)  # an unknown shape fails before any work
    root = pathlib.Path(cache) if cache is not None else default_cache()
    folder = root / f"{shape}-{size}-{_key(shape, recipe)}"
    if (folder / "training.json").exists():
        return folder
    import shutil
    import tempfile

    root.mkdir(parents=True, exist_ok=True)
    model, loss = _train(shape, recipe)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))  # same filesystem: the rename is atomic
    try:
        model.save_pretrained(staging)
        write_byte_tokenizer(staging)
        (staging / "training.json").write_text(json.dumps({"shape": shape, "size": size, **dataclasses.asdict(recipe),
                                                           "final_loss": loss}, indent=1))
        try:
            os.replace(staging, folder)  # a half-written folder is never seen
        except OSError:
            if not (folder / "training.json").exists():  # another process won the race: its folder is the same
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
