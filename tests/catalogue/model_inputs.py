"""Valid inputs for a model of any architecture, by its forward's parameters and its config
(:func:`make_inputs`): token ids, pixels, videos, audio features, waveforms, a codec decoder's
latents, spectrograms, patches with their grid, past values, a trajectory's states and returns."""

from __future__ import annotations

import inspect
import math
from typing import Any

from catalogue.media_inputs import (
    audio_inputs,
    codec_of,
    extractor_features,
    find_key,
    first_conv_channels,
    forward_parameters,
    grid_patches,
    image_inputs,
    image_size_of,
    matches_keypoints,
    packed_patches,
    patch_inputs,
    policy_inputs,
    required_parameters,
    text_beside_pixels,
    token_ids,
)
from catalogue.overrides import BATCH, SEQUENCE


def make_inputs(model, config, images: bool = True) -> dict[str, Any]:
    """Valid example inputs by the model's main input (token ids, pixels or videos, log-mel features,
    waveforms, patches with their grid or positions, flattened patches, past values, embeddings),
    batch 2, and what the forward requires beside it (a pixel model's text prompt, a Q-Former's
    prompt, region features, a task prompt, feature masks); a vision-language model also gets
    images unless ``images=False``."""
    import torch

    generator = torch.Generator().manual_seed(0)
    parameters = forward_parameters(model)
    main = getattr(model, "main_input_name", "input_ids")
    if isinstance(main, str) and main not in parameters and "input_ids" in parameters:
        main = "input_ids"  # a text tower inheriting its composite's main input (SAM 3 Lite's: pixel_values)
    inputs: dict[str, Any] = {}
    if not _structured_main_input(model, config, main, parameters, generator, inputs):
        if not _other_main_input(model, config, main, parameters, generator, inputs):
            _text_inputs(model, config, parameters, generator, images, inputs)
    _prompts_and_noise(model, config, parameters, generator, inputs)
    _required_beside(model, config, parameters, generator, inputs)
    _decoder_inputs(model, config, parameters, generator, inputs)
    return inputs


def _structured_main_input(model, config, main, parameters, generator, inputs: dict[str, Any]) -> bool:
    """Patches with their grid, a forecaster's or time-series model's past, pixels, log-mel features
    (False: the main input is none of them)."""
    grid = next((name for name in ("grid_thw", "image_grid_thw") if name in parameters), None)
    if grid and "input_ids" not in parameters:  # a Qwen-VL-style vision tower: flattened patches and their grid
        _grid_main_input(config, parameters, generator, grid, inputs)
    elif "target_sizes" in parameters and "input_ids" not in parameters and main == "pixel_values":
        inputs.update(packed_patches(config, generator))
    elif "past_time_features" in parameters:  # a probabilistic forecaster: its context plus the largest lag
        _forecaster_inputs(config, generator, inputs)
    elif main == "past_values" or "past_values" in parameters:  # a time-series model: (batch, context, channels)
        _past_values(config, parameters, generator, inputs)
    elif main in ("pixel_values", "pixel_values_videos") or ("pixel_values" in parameters and "input_ids" not in parameters):
        _pixel_main_input(model, config, main, parameters, generator, inputs)
    elif main == "input_features":
        _features_main_input(model, config, parameters, generator, inputs)
    else:
        return False
    return True


def _other_main_input(model, config, main, parameters, generator, inputs: dict[str, Any]) -> bool:
    """Waveforms and latents, flattened patches, embeddings, trajectories, a policy's state, audio
    log-mel, a generic ``inputs`` (False: none of them, the main input is text)."""
    import torch

    if main in ("input_values", "latents"):  # a codec's decoder reads its latents (Mimi's)
        inputs.update(_waveform(model, config, generator))
    elif main == "flattened_patches":
        _flattened_patches(config, parameters, generator, inputs)
    elif isinstance(main, str) and main.endswith("_embeds") and "input_ids" not in parameters and isinstance(getattr(config, "hidden_size", None), int):
        # a forward reading embeddings another model made (Nemotron's word timestamps over audio frames)
        inputs[main] = torch.randn(BATCH, SEQUENCE, config.hidden_size, generator=generator)
        if "attention_mask" in parameters:
            inputs["attention_mask"] = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
    elif main == "states" and isinstance(getattr(config, "state_dim", None), int):
        _trajectory(config, parameters, generator, inputs)
    elif isinstance(getattr(config, "max_state_dim", None), int) and isinstance(getattr(config, "max_action_dim", None), int):
        inputs.update(policy_inputs(model, config, generator))
    elif main == "audio_mel":  # Gemma 3n's audio tower: (batch, frames, bins) log-mel and its padding mask (True: padded)
        bins = getattr(config, "input_feat_size", None) or 128
        inputs["audio_mel"] = torch.randn(BATCH, 64, bins, generator=generator)
        inputs["audio_mel_mask"] = torch.zeros(BATCH, 64, dtype=torch.bool)
    elif main == "inputs" and "input_ids" not in parameters:  # a forward whose input is generic (`inputs`)
        encoder = getattr(model, "encoder", None)
        if isinstance(encoder, torch.nn.Module) and getattr(config, "encoder", None) is not None:
            # a composite speech encoder-decoder: its encoder's inputs, under their own names
            inputs.update({k: v for k, v in make_inputs(encoder, config.encoder).items() if hasattr(v, "shape")})
        elif isinstance(getattr(config, "d_model", None), int):  # Perceiver without a preprocessor: embeddings
            inputs["inputs"] = torch.randn(BATCH, SEQUENCE, config.d_model, generator=generator)
    else:
        return False
    return True


def _grid_main_input(config, parameters, generator, grid: str, inputs: dict[str, Any]) -> None:
    import torch

    patches = grid_patches(config, generator)
    pixels = "hidden_states" if "hidden_states" in parameters and "pixel_values" not in parameters else "pixel_values"
    inputs[pixels], inputs[grid] = patches["pixel_values"], patches["image_grid_thw"]
    if "merge_sizes" in parameters:
        inputs["merge_sizes"] = torch.tensor([getattr(config, "spatial_merge_size", None) or 1] * BATCH)


def _forecaster_inputs(config, generator, inputs: dict[str, Any]) -> None:
    import torch

    lags = getattr(config, "lags_sequence", None) or [0]
    length = (getattr(config, "context_length", None) or 32) + max(lags)
    size = getattr(config, "input_size", None) or 1
    shape = (BATCH, length) if size == 1 else (BATCH, length, size)  # univariate series come as (batch, time)
    features = getattr(config, "num_time_features", None) or 0
    inputs["past_values"] = torch.randn(*shape, generator=generator)
    inputs["past_time_features"] = torch.randn(BATCH, length, features, generator=generator)
    inputs["past_observed_mask"] = torch.ones(*shape)


def _past_values(config, parameters, generator, inputs: dict[str, Any]) -> None:
    import torch

    length = getattr(config, "context_length", None) or 32
    channels = getattr(config, "num_input_channels", None)
    patch = getattr(config, "patch_length", None)
    if channels is None and isinstance(patch, int):
        # a univariate patched forecaster (TimesFM): (batch, whole patches), their padding flags and frequency
        inputs["past_values"] = torch.randn(BATCH, 4 * patch, generator=generator)
        if "past_values_padding" in parameters:
            inputs["past_values_padding"] = torch.zeros(BATCH, 4 * patch, dtype=torch.long)
        if "freq" in parameters:
            inputs["freq"] = torch.zeros(BATCH, 1, dtype=torch.long)
    else:
        inputs["past_values"] = torch.randn(BATCH, length, channels or 1, generator=generator)


def _pixel_main_input(model, config, main, parameters, generator, inputs: dict[str, Any]) -> None:
    import torch

    vision = getattr(config, "vision_config", None) or config
    height, width = image_size_of(vision)
    channels = getattr(vision, "num_channels", 3) or 3
    frames = getattr(vision, "num_frames", None) or getattr(config, "num_frames", None)
    if "ForImage" in type(model).__name__:  # an image head of a config that also describes video (Perceiver's)
        frames = None
    # a video model by its input's name or by a video token in its text (InstructBLIP-Video)
    video = main == "pixel_values_videos" or any(k.startswith("video_token") for k in config.to_dict())
    required = required_parameters(model)
    if (required | parameters & {"spatial_shapes"}) & {"spatial_shapes", "pixel_position_ids", "aspect_ratio_ids"}:
        inputs.update(patch_inputs(model, vision, generator))
    elif type(model).__name__.endswith("ForKeypointMatching") or matches_keypoints(config):  # a pair of images to match per row
        inputs["pixel_values"] = torch.randn(BATCH, 2, channels, height, width, generator=generator)
    elif video or (isinstance(frames, int) and frames > 0):  # a video model reads (batch, frames, channels, height, width)
        frames = frames if isinstance(frames, int) and frames > 0 else 2 * (getattr(vision, "tubelet_size", None) or 1)
        inputs[main if video else "pixel_values"] = torch.randn(BATCH, frames, channels, height, width, generator=generator)
    else:
        inputs["pixel_values"] = torch.randn(BATCH, channels, height, width, generator=generator)
    inputs.update(text_beside_pixels(model, config, dict(inputs), generator))
    _beside_pixels(model, config, required, height, generator, inputs)


def _beside_pixels(model, config, required: set[str], height: int, generator, inputs: dict[str, Any]) -> None:
    """What a pixel model requires beside its pixels: a patch mask, an example image and its mask, a task prompt."""
    import torch

    if "bool_masked_pos" in required:  # a masked-patch pretraining head (VideoMAE): half of each row's patches
        patches = next((m.num_patches for m in model.modules() if isinstance(getattr(m, "num_patches", None), int)), None)
        if patches:
            order = torch.stack([torch.randperm(patches, generator=generator) for _ in range(BATCH)])
            inputs["bool_masked_pos"] = order < patches // 2  # as many masked in every row, as the head needs
    prompts = sorted(required & {"prompt_pixel_values", "prompt_masks"})
    if prompts and "pixel_values" in inputs:
        # SegGPT: an example image and its mask, stacked above the input to fill image_size
        inputs["pixel_values"] = inputs["pixel_values"][..., : height // 2, :].contiguous()
        for name in prompts:
            inputs[name] = torch.randn(inputs["pixel_values"].shape, generator=generator)
    if "task_inputs" in required_parameters(model):  # OneFormer's task prompt, tokenized to its task_seq_len
        vocab = getattr(config, "text_encoder_vocab_size", None) or 100
        length = getattr(config, "task_seq_len", None) or SEQUENCE
        inputs["task_inputs"] = torch.randint(3, min(vocab, 100), (BATCH, length), generator=generator)


def _features_main_input(model, config, parameters, generator, inputs: dict[str, Any]) -> None:
    import torch

    bins = next((getattr(part, key) for part in (config, getattr(config, "encoder_config", None), getattr(config, "audio_config", None))
                 for key in ("num_mel_bins", "feature_size") if isinstance(getattr(part, key, None), int)), None)  # an ASR model's encoder's
    # or the speech tower's under another name (Nemotron's asr_config), or its feature extractor's (Gemma 4's audio tower)
    bins = bins or find_key(config.to_dict(), "num_mel_bins") or extractor_features(config) or 80
    stacked = getattr(config, "feature_projection_input_dim", None)  # w2v-BERT stacks frames: (batch, frames, 2 x bins)
    whisper_style = getattr(config, "num_mel_bins", None) and "speech_to_text" not in config.model_type
    if getattr(config, "max_source_positions", None) and whisper_style:  # reads exactly 2 x positions frames
        inputs["input_features"] = torch.randn(BATCH, bins, 2 * config.max_source_positions, generator=generator)
    elif isinstance(stacked, int):
        inputs["input_features"] = torch.randn(BATCH, 64, stacked, generator=generator)
    elif isinstance(getattr(config, "num_stacked_frames", None), int):  # low-frame-rate stacking (FunASR): (batch, frames, k x bins)
        inputs["input_features"] = torch.randn(BATCH, 16, bins * config.num_stacked_frames, generator=generator)
    else:
        inputs["input_features"] = _log_mel(model, config, bins, generator)
    if "input_features_mask" in parameters:  # every frame valid, as an extractor gives unpadded audio
        features = inputs["input_features"]
        frames = features.shape[-1] if features.shape[1] == bins else features.shape[1]
        inputs["input_features_mask"] = torch.ones(BATCH, frames, dtype=torch.long)


def _log_mel(model, config, bins: int, generator):
    import torch

    window = getattr(config, "n_window", None)  # a windowed encoder (Qwen3-ASR) reads whole windows of 2 x n_window frames
    frames = 2 * window if isinstance(window, int) and window > 0 else 64
    shape = (BATCH, frames, bins) if "speech_to_text" in config.model_type else (BATCH, bins, frames)
    first = next((m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.nn.Parameter)), None)
    width = getattr(first, "in_features", None) if isinstance(first, torch.nn.Linear) else None
    if isinstance(width, int) and width > bins and width % bins == 0 and find_key(config.to_dict(), "subsampling_factor") is None:
        # an extractor stacking each frame's mel with its deltas and neighbours (Granite Speech 5): as wide as the
        # linear projection that reads them first (a model stacking them itself says by its subsampling_factor)
        shape = (BATCH, frames, width)
    return torch.randn(*shape, generator=generator)


def _flattened_patches(config, parameters, generator, inputs: dict[str, Any]) -> None:
    import torch

    # Pix2Struct's processor: patches flattened with their (row, column), 1-based, first
    vision = getattr(config, "vision_config", None) or config
    width = getattr(vision, "patch_embed_hidden_size", None) or 3 * 16 * 16
    rows, columns = torch.meshgrid(torch.arange(1, 5), torch.arange(1, 5), indexing="ij")
    places = torch.stack([rows.flatten(), columns.flatten()], dim=-1).float().expand(BATCH, -1, -1)
    inputs["flattened_patches"] = torch.cat([places, torch.randn(BATCH, 16, width, generator=generator)], dim=-1)
    if "attention_mask" in parameters:
        inputs["attention_mask"] = torch.ones(BATCH, 16, dtype=torch.long)


def _trajectory(config, parameters, generator, inputs: dict[str, Any]) -> None:
    import torch

    # an offline-RL trajectory (Decision Transformer): per step a state, an action, a reward, the
    # return to go, and the step's index within the episode
    steps = SEQUENCE
    inputs["states"] = torch.randn(BATCH, steps, config.state_dim, generator=generator)
    if "actions" in parameters:
        inputs["actions"] = torch.randn(BATCH, steps, getattr(config, "act_dim", None) or 1, generator=generator)
    for name in ("rewards", "returns_to_go"):
        if name in parameters:
            inputs[name] = torch.randn(BATCH, steps, 1, generator=generator)
    if "timesteps" in parameters:
        inputs["timesteps"] = torch.arange(steps).expand(BATCH, -1).clone()
    if "attention_mask" in parameters:
        inputs["attention_mask"] = torch.ones(BATCH, steps, dtype=torch.long)


def _text_inputs(model, config, parameters, generator, images: bool, inputs: dict[str, Any]) -> None:
    """Token ids (the main input is text), and what a text model reads beside them: boxes, images,
    regions, global attention, audio or a voice's log-mel."""
    import torch

    # a multiple-choice head reads (batch, choices, sequence)
    shape = (BATCH, 2, SEQUENCE) if type(model).__name__.endswith("ForMultipleChoice") else (BATCH, SEQUENCE)
    codebooks = getattr(config, "num_codebooks", None)
    streams = isinstance(codebooks, int) and isinstance(getattr(config, "codebook_vocab_size", None), int)
    if isinstance(codebooks, int) and codebooks > 1 and not getattr(config, "is_encoder_decoder", False) and not streams:
        shape = (BATCH * codebooks, SEQUENCE)  # an audio-codes decoder (MusicGen) reads one row per codebook
    inputs["input_ids"] = token_ids(config, shape, generator)
    if streams and "inputs_embeds" in parameters and "input_values" not in parameters:
        # a text stream beside the audio's codebooks (Kyutai's speech-to-text): per step a text token and
        # one code per codebook, (batch, sequence, 1 + codebooks)
        codes = torch.randint(0, config.codebook_vocab_size, (*shape, codebooks), generator=generator)
        inputs["input_ids"] = torch.cat([inputs["input_ids"][..., None], codes], dim=-1)
    if "bbox" in parameters:  # document models: one box (x0, y0, x1, y1 within 0..1000) per token
        corner = torch.randint(0, 500, (*shape, 2), generator=generator)
        inputs["bbox"] = torch.cat([corner, corner + torch.randint(1, 500, (*shape, 2), generator=generator)], dim=-1)
    if "attention_mask" in parameters:
        inputs["attention_mask"] = torch.ones(*shape, dtype=torch.long)
    vision = _images_beside_text(model, config, parameters, generator, shape, inputs)
    _regions_and_global_attention(model, config, parameters, generator, images, shape, vision, inputs)
    _audio_beside_text(model, config, parameters, generator, images, shape, inputs)


def _images_beside_text(model, config, parameters, generator, shape: tuple, inputs: dict[str, Any]):
    """A dual encoder's or single-stream model's images beside the text; the vision config (or None)."""
    import torch

    image_tokens = [k for k in config.to_dict() if k.startswith(("image_token", "video_token"))]
    vision = getattr(config, "vision_config", None)
    if "pixel_values" in parameters and vision is None and isinstance(getattr(config, "modality_type_vocab_size", None), int):
        vision = config  # a single-stream model embedding text and image patches together (ViLT)
    if "pixel_values" in parameters and vision is not None and not image_tokens and "spatial_shapes" in parameters:
        inputs.update(patch_inputs(model, vision, generator))  # a dual encoder over NaFlex patches (SigLIP 2)
    elif "pixel_values" in parameters and vision is not None and not image_tokens:  # dual encoders (CLIP)
        height, width = image_size_of(vision)
        channels = getattr(vision, "num_channels", 3) or 3
        frames = getattr(vision, "num_frames", None)
        if isinstance(frames, int) and frames > 0:  # a video-text dual encoder (X-CLIP): (batch, frames, channels, h, w)
            inputs["pixel_values"] = torch.randn(BATCH, frames, channels, height, width, generator=generator)
        elif "image_attention_mask" in parameters:
            # IDEFICS: images per row (one here), and which images each token attends to (all)
            inputs["pixel_values"] = torch.randn(BATCH, 1, channels, height, width, generator=generator)
            inputs["image_attention_mask"] = torch.ones(*shape, 1, dtype=torch.long)
        else:
            inputs["pixel_values"] = torch.randn(BATCH, channels, height, width, generator=generator)
    return vision


def _regions_and_global_attention(model, config, parameters, generator, images: bool, shape: tuple, vision, inputs: dict[str, Any]) -> None:
    import torch

    if "visual_feats" in parameters and isinstance(getattr(config, "visual_feat_dim", None), int):
        # a two-stream model over detected regions (LXMERT): a detector's region features and boxes
        regions = 4
        inputs["visual_feats"] = torch.randn(BATCH, regions, config.visual_feat_dim, generator=generator)
        corner = torch.rand(BATCH, regions, 2, generator=generator) / 2
        inputs["visual_pos"] = torch.cat([corner, corner + 0.5], dim=-1)[..., : getattr(config, "visual_pos_dim", 4)]
    if "global_attention_mask" in parameters and type(model).__name__.endswith(("ForQuestionAnswering", "ForMultipleChoice")):
        # Longformer's question-answering heads look for separator tokens to put global attention on the
        # question; what a pipeline does instead: global attention on the first token
        inputs["global_attention_mask"] = torch.zeros(*shape, dtype=torch.long)
        inputs["global_attention_mask"][..., 0] = 1
    elif images and "pixel_values" in parameters and vision is not None and shape == (BATCH, SEQUENCE):
        inputs.update(image_inputs(model, config, inputs["input_ids"], generator))


def _audio_beside_text(model, config, parameters, generator, images: bool, shape: tuple, inputs: dict[str, Any]) -> None:
    import torch

    if images and "input_features" in parameters and getattr(config, "audio_config", None) is not None and shape == (BATCH, SEQUENCE):
        inputs.update(audio_inputs(model, config, inputs["input_ids"], generator))
    elif "input_features" in parameters and getattr(config, "audio_config", None) is None:
        # a text-to-speech model conditioned on a voice's log-mel (CLVP): (batch, bins, frames), the bins
        # its conditioning encoder's convolution reads
        bins = find_key(config.to_dict(), "num_mel_bins") or find_key(config.to_dict(), "feature_size")
        if isinstance(bins, int) and bins > 1:
            inputs["input_features"] = torch.randn(BATCH, bins, 64, generator=generator)


def _prompts_and_noise(model, config, parameters, generator, inputs: dict[str, Any]) -> None:
    """A question token, a generative answer's start, and the noise a forward would draw itself."""
    import torch

    question = getattr(config, "question_token_id", None)
    if isinstance(question, int) and "question_positions" in parameters and inputs.get("input_ids") is not None:
        # Splinter's processor puts a question token ([QUESTION]) in each row: the span heads start from it
        inputs["input_ids"][:, 1] = question
    if "decoder_input_ids" in parameters and not getattr(config, "is_encoder_decoder", False) and "pixel_values" in inputs:
        if type(model).__name__.endswith("ForQuestionAnswering"):  # a generative answer head (BLIP's VQA): the answer's start
            inputs["decoder_input_ids"] = token_ids(config, (BATCH, 4), generator)
    patches = next((m.num_patches for m in model.modules() if isinstance(getattr(m, "num_patches", None), int)), None)
    if patches is None:  # masking by units of patches (Hiera): one value per unit
        units = next((m.mask_spatial_shape for m in model.modules() if isinstance(getattr(m, "mask_spatial_shape", None), (list, tuple))), None)
        patches = math.prod(units) if units and all(isinstance(u, int) for u in units) else None
    if "noise" in parameters and "noise" not in inputs and "pixel_values" in inputs and patches:
        # random masking (ViT-MAE) draws its noise inside forward unless given: one value per patch (or
        # unit), fixed, so PyTorch and both files mask the same patches
        inputs["noise"] = torch.rand(BATCH, patches, generator=generator)
    features = inputs.get("input_features")
    channels = getattr(config, "model_in_channels", None)
    if "noise_sequence" in parameters and getattr(features, "dim", lambda: 0)() == 3 and isinstance(channels, int):
        # a vocoder (UnivNet) draws its noise inside forward unless given: (batch, frames, channels), fixed;
        # frames: the axis that is not the mel bins (the features may yet be transposed, see _build)
        frames = features.shape[2] if features.shape[1] == getattr(config, "num_mel_bins", None) else features.shape[1]
        inputs["noise_sequence"] = torch.randn(BATCH, frames, channels, generator=generator)


def _required_beside(model, config, parameters, generator, inputs: dict[str, Any]) -> None:
    """Embeddings and audio a forward requires, the cache off, a VAE's deterministic path."""
    import torch

    width = getattr(config, "hidden_size", None)
    for name in sorted(required_parameters(model) - set(inputs)):
        if name.endswith("_embeds") and isinstance(width, int):
            # embeddings a caller computes (a Q-Former's queries): (batch, sequence, hidden)
            inputs[name] = torch.randn(BATCH, SEQUENCE, width, generator=generator)
            memory = getattr(config, "encoder_hidden_size", None)
            if "encoder_hidden_states" in parameters and isinstance(memory, int):  # what its cross-attention reads (an image's)
                inputs["encoder_hidden_states"] = torch.randn(BATCH, 2 * SEQUENCE, memory, generator=generator)
    if "input_values" in required_parameters(model) and "input_values" not in inputs:  # audio beside text (PE Audio)
        inputs.update(_waveform(model, config, generator))
    if "use_cache" in parameters:  # no cache object in the outputs: torch.export needs its pytree registered
        inputs["use_cache"] = False
    if "sample" in parameters and inspect.signature(model.forward).parameters["sample"].default is True:
        # a VAE that draws its latents by default (VibeVoice's acoustic tokenizer: noise from torch.randn, which
        # no file reproduces): the encoder's mean, deterministic, as its decoding path takes it
        inputs["sample"] = False


def _decoder_inputs(model, config, parameters, generator, inputs: dict[str, Any]) -> None:
    """A speech decoder's frames and speaker, an encoder-decoder's decoder tokens."""
    import torch

    if "decoder_input_values" in parameters and isinstance(getattr(config, "hidden_size", None), int):
        # a speech decoder (SpeechT5's): mel frames when a layer reads them (its speech pre-net), else
        # hidden states; and the speaker's embedding its pre-net reads beside them
        bins = getattr(config, "num_mel_bins", None)
        mels = isinstance(bins, int) and any(isinstance(m, torch.nn.Linear) and m.in_features == bins for m in model.modules())
        inputs["decoder_input_values"] = torch.randn(BATCH, 4, bins if mels else config.hidden_size, generator=generator)
        speaker = getattr(config, "speaker_embedding_dim", None)
        if mels and "speaker_embeddings" in parameters and isinstance(speaker, int):
            inputs["speaker_embeddings"] = torch.randn(BATCH, speaker, generator=generator)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
        if type(model).__name__.endswith("ForSequenceClassification") and "input_ids" in inputs:
            # BART-style heads classify at each row's last end-of-sequence token, read from the decoder's
            # states over the same tokens: one EOS per row, the decoder input made from input_ids
            eos = getattr(config, "eos_token_id", None)
            if isinstance(eos, int):
                inputs["input_ids"][:, -1] = eos
        else:
            _decoder_tokens(config, generator, inputs)


def _decoder_tokens(config, generator, inputs: dict[str, Any]) -> None:
    decoder = getattr(config, "decoder", None) or getattr(config, "decoder_config", None)
    codebooks = getattr(decoder, "num_codebooks", None)  # MusicGen: a row per codebook
    rows = BATCH * codebooks if isinstance(codebooks, int) and codebooks > 1 else BATCH
    channels = getattr(decoder, "num_channels", None)
    if codebooks is None and isinstance(channels, int) and channels > 1:
        # an audio decoder over parallel channels of codes (Dia): (batch, length, channels), the layout
        # it works in (its flattened one's view fails in eager PyTorch)
        inputs["decoder_input_ids"] = token_ids(config, (BATCH, 4, channels), generator)
    else:
        inputs["decoder_input_ids"] = token_ids(config, (rows, 4), generator)


def _waveform(model, config, generator) -> dict[str, Any]:
    """Raw audio under the forward's name for it: (batch, samples) for a speech encoder; (batch,
    channels, samples) for a codec, known by its channel count (``audio_channels``, ``channels``)
    or its stride ratios (EnCodec, Mimi, DAC), which some codecs' forwards call ``hidden_states``."""
    import torch

    # an x-vector head's time-delay layers need more frames than a quarter second gives
    samples = 16000 if getattr(config, "tdnn_kernel", None) else 4000
    per_token = getattr(config, "samples_per_token", None)
    if isinstance(per_token, int) and per_token > 0:  # an encoder collapsing that many samples into a token reads whole tokens (Muse Spark)
        samples = -(-samples // per_token) * per_token
    channels, strides = codec_of(config.to_dict())
    parameters, required = forward_parameters(model), required_parameters(model)
    name = "hidden_states" if "input_values" not in parameters and "hidden_states" in required else "input_values"
    name = "latents" if "latents" in required else name
    bins, length = getattr(config, "num_mel_bins", None), getattr(config, "max_length", None)
    if channels is None and not strides and isinstance(bins, int) and isinstance(length, int):
        # a spectrogram transformer (AST) reads the extractor's (batch, max_length frames, bins), its positions sized for them
        return {name: torch.randn(BATCH, length, bins, generator=generator)}
    width = getattr(config, "hidden_size", None)
    if channels is None and not strides and "decoder_input_values" in parameters and first_conv_channels(model) is None and isinstance(width, int):
        # an encoder-decoder without a speech front end (SpeechT5's bare model) reads hidden states
        return {name: torch.randn(BATCH, SEQUENCE, width, generator=generator)}
    if channels is None and not strides:
        return {name: torch.randn(BATCH, samples, generator=generator)}
    width = first_conv_channels(model) if name in ("latents", "hidden_states") else None
    if width is not None and width != (channels or 1):
        # a codec's decoder (Mimi's, VibeVoice's) reads latents, not audio: (batch, latent width, frames)
        return {name: torch.randn(BATCH, width, SEQUENCE, generator=generator)}
    out = {name: torch.randn(BATCH, channels or 1, samples, generator=generator)}
    stacked = find_key(config.to_dict(), "feature_projection_input_dim")
    ratios = getattr(config, "downsampling_ratios", None)
    if "input_features" in required and isinstance(stacked, int) and isinstance(ratios, (list, tuple)):
        # a codec with a semantic (w2v-BERT) encoder beside its acoustic one (XCodec2): stacked
        # features of one frame per acoustic frame, so both encoders' frames line up
        hop = math.prod(ratios)
        frames = max(1, samples // hop)
        out[name] = torch.randn(BATCH, channels or 1, frames * hop, generator=generator)
        out["input_features"] = torch.randn(BATCH, frames, stacked, generator=generator)
    return out
