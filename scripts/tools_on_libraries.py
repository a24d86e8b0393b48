"""Every file tool on models of the other libraries people export (issue 51): timm, torchvision and
diffusers, each model built from its constructor with random weights (nothing downloaded), each
through the catalogue sweep's own export jobs and tools phase (``tests/catalogue/tools_phase.py``).

    python scripts/tools_on_libraries.py [--only timm/resnet18,...] [--json out.json]

A library not installed is skipped with a line saying so: torchvision imports beside torch 2.15
only on this project's machine (docs/compatibility.md), and timm needs torchvision. Each model runs
in a bounded child (the sweep's ``run_child``), so a crash or a time-out is a row, not the end.
Prints one line per model and writes the rows to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the catalogue of models (tests/catalogue/)
sys.path.insert(0, str(ROOT))

from catalogue import jobs, tools_phase  # noqa: E402

IMAGE = (2, 3, 64, 64)

#: (library, name): how to build it and its inputs; timm models at 64x64 where they take any size
MODELS: dict[str, dict[str, Any]] = {
    "timm/resnet18": {"timm": "resnet18"},
    "timm/efficientnet_b0": {"timm": "efficientnet_b0"},
    "timm/mobilenetv3_small_100": {"timm": "mobilenetv3_small_100"},
    "timm/convnext_atto": {"timm": "convnext_atto"},
    "timm/regnetx_002": {"timm": "regnetx_002"},
    "timm/vit_tiny_patch16_224": {"timm": "vit_tiny_patch16_224", "kwargs": {"img_size": 64}},
    "timm/deit_tiny_patch16_224": {"timm": "deit_tiny_patch16_224", "kwargs": {"img_size": 64}},
    "timm/swin_tiny_patch4_window7_224": {"timm": "swin_tiny_patch4_window7_224", "kwargs": {"img_size": 224}, "size": 224},
    "torchvision/resnet18": {"torchvision": "resnet18"},
    "torchvision/mobilenet_v3_small": {"torchvision": "mobilenet_v3_small"},
    "torchvision/efficientnet_b0": {"torchvision": "efficientnet_b0"},
    "torchvision/shufflenet_v2_x0_5": {"torchvision": "shufflenet_v2_x0_5"},
    "torchvision/squeezenet1_1": {"torchvision": "squeezenet1_1"},
    "torchvision/densenet121": {"torchvision": "densenet121"},
    "torchvision/regnet_y_400mf": {"torchvision": "regnet_y_400mf"},
    "torchvision/convnext_tiny": {"torchvision": "convnext_tiny"},
    "diffusers/UNet2DModel": {"diffusers": "UNet2DModel"},
    "diffusers/UNet2DConditionModel": {"diffusers": "UNet2DConditionModel"},
    "diffusers/AutoencoderKL": {"diffusers": "AutoencoderKL"},
}


def _diffusers(name: str):
    import diffusers
    import torch

    small = {"block_out_channels": (32, 64), "layers_per_block": 1, "norm_num_groups": 8}
    if name == "UNet2DModel":
        model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, attention_head_dim=8,
                                      down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                      up_block_types=("AttnUpBlock2D", "UpBlock2D"), **small)
        return model, {"sample": torch.randn(2, 3, 16, 16), "timestep": torch.tensor([10, 500]), "return_dict": False}
    if name == "UNet2DConditionModel":
        model = diffusers.UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, cross_attention_dim=32,
                                               attention_head_dim=8,
                                               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), **small)
        return model, {"sample": torch.randn(2, 4, 16, 16), "timestep": torch.tensor([10, 500]),
                       "encoder_hidden_states": torch.randn(2, 7, 32), "return_dict": False}
    model = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                                    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                                    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), **small)
    return model, {"sample": torch.randn(2, 3, 32, 32), "sample_posterior": False, "return_dict": False}


def build(key: str):
    """``(model, inputs)`` of one entry, eval mode, random weights (seeded)."""
    import torch

    torch.manual_seed(0)
    spec = MODELS[key]
    if "timm" in spec:
        import timm

        model = timm.create_model(spec["timm"], pretrained=False, num_classes=10, **spec.get("kwargs", {}))
    elif "torchvision" in spec:
        import torchvision

        model = torchvision.models.get_model(spec["torchvision"], weights=None, num_classes=10)
    else:
        model, inputs = _diffusers(spec["diffusers"])
        return model.eval(), inputs
    size = spec.get("size", IMAGE[-1])
    return model.eval(), {"x": torch.randn(*IMAGE[:2], size, size)}


def _job(key: str, folder: str) -> dict[str, Any]:
    """Both exports of one entry into ``folder`` (in a bounded child): the sweep's three files."""
    import warnings

    import torch

    from onnx_modular import export_modular

    warnings.simplefilter("ignore")
    model, inputs = build(key)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    record: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    result = export_modular(model, (), pathlib.Path(folder) / tools_phase.MODULAR, kwargs=inputs)
    record.update(modular_ok=bool(result.report.ok), max_abs=result.report.max_abs)
    try:
        torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False).save(str(pathlib.Path(folder) / tools_phase.FLAT))
        record["flat_ok"] = True
    except Exception as e:  # modularize is then n/a
        record.update(flat_ok=False, flat_error=f"{type(e).__name__}: {str(e)[:200]}")
    tools_phase.save_inputs(pathlib.Path(folder), tensors)
    return record


def _installed(library: str) -> bool:
    try:
        __import__(library)
        return True
    except Exception:  # torchvision's own import fails beside some torch builds
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated keys (default: every model of an installed library)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--memory-gb", type=float, default=8)
    args = parser.parse_args(argv)
    keys = args.only.split(",") if args.only else list(MODELS)
    jobs.JOBS["library"] = lambda _type, key, folder: _job(key, folder)
    rows = []
    for key in keys:
        library = key.split("/", 1)[0]
        if not _installed(library):
            print(f"{key:40} skipped: {library} does not import here", flush=True)
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="tools-lib-") as folder:
            record = jobs.run_child("library", library, key, args.timeout, args.memory_gb, folder)
            row = {"model": key, **{k: v for k, v in record.items() if k != "trace"}}
            if record.get("modular_ok"):
                row["tools"] = {}
                for tool in tools_phase.TOOLS:
                    got = jobs.run_child("tool", library, key, args.timeout, args.memory_gb, tool, folder)
                    row["tools"][tool] = got.get("status") or f"{got.get('stage')}: {got.get('error')}"
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        cell = tools_phase.cell(row.get("tools")) if row.get("tools") else row.get("error", "modular export failed")
        print(f"{key:40} modular={row.get('modular_ok')} flat={row.get('flat_ok')} {row['seconds']:6.0f}s  {cell[:200]}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    passed = sum(1 for r in rows if r.get("tools") and all(tools_phase.passed(s) or s.startswith("n/a") for s in r["tools"].values()))
    print(f"{passed} of {len(rows)} models: every tool passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
