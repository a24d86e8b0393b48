"""Models of the kinds outside transformers (torchvision, timm, diffusers, hand-written structures),
written here by hand: no such library is imported.

Each builder returns ``(model, inputs)``: an eval-mode module with random weights and its keyword
inputs. They are small (a few thousand to a few hundred thousand parameters) but keep the
structures each kind is known for: Conv+BatchNorm chains torch's optimizer fuses, depthwise
convolutions and squeeze-excitation, channels-last LayerNorm with a layer scale, a UNet's
timestep embedding, GroupNorm, spatial attention, skip concatenations and resampling, a class
token, a module called twice, a recurrent layer.
"""

from __future__ import annotations

import math

import torch
from models import BasicBlock  # torchvision's block, shared with the suite's ResNet-like model
from torch import nn
from torch.nn import functional as F

# -- torchvision: a ResNet (Conv+BatchNorm+ReLU, a strided downsample, adaptive pooling) ----


class ResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 16))
        self.layer2 = nn.Sequential(BasicBlock(16, 32, 2), BasicBlock(32, 32))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# -- torchvision / timm: a MobileNetV3 (depthwise convolutions, squeeze-excitation, hardswish) --


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        scale = F.hardsigmoid(self.fc2(F.relu(self.fc1(self.avgpool(x)))))
        return x * scale


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, expand: int, cout: int, stride: int):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(cin, expand, 1, bias=False), nn.BatchNorm2d(expand), nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(expand, expand, 3, stride, 1, groups=expand, bias=False),
                                       nn.BatchNorm2d(expand), nn.Hardswish())
        self.se = SqueezeExcitation(expand, max(8, expand // 4))
        self.project = nn.Sequential(nn.Conv2d(expand, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        out = self.project(self.se(self.depthwise(self.expand(x))))
        return x + out if self.residual else out


class MobileNetV3(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.blocks = nn.Sequential(InvertedResidual(16, 32, 16, 1), InvertedResidual(16, 48, 24, 2),
                                    InvertedResidual(24, 72, 24, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(24, 64), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(64, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


# -- timm: a ConvNeXt (7x7 depthwise, channels-last LayerNorm, layer scale, DropPath) --------


class DropPath(nn.Module):
    """timm's stochastic depth: the identity in eval."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(x.shape[0], *([1] * (x.dim() - 1)), device=x.device) >= self.p
        return x * keep / (1 - self.p)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))
        self.drop_path = DropPath(0.1)

    def forward(self, x):
        shortcut = x
        x = self.norm(self.conv_dw(x).permute(0, 2, 3, 1))
        x = (self.mlp(x) * self.gamma).permute(0, 3, 1, 2)
        return shortcut + self.drop_path(x)


class ConvNeXt(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 4, 4), nn.GroupNorm(1, 32))
        self.stages = nn.Sequential(ConvNeXtBlock(32), ConvNeXtBlock(32))
        self.head_norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.head(self.head_norm(x.mean((2, 3))))


# -- diffusers: a UNet (timestep embedding, GroupNorm+SiLU resnets, attention, skips) --------


def timestep_embedding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    angles = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, cin: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(cin, dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, sample):
        return self.linear_2(self.act(self.linear_1(sample)))


class ResnetBlock2D(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(4, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb, cout)
        self.norm2 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.nonlinearity = nn.SiLU()
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x, temb):
        h = self.conv1(self.nonlinearity(self.norm1(x)))
        h = h + self.time_emb_proj(self.nonlinearity(temb))[:, :, None, None]
        h = self.conv2(self.nonlinearity(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class SpatialAttention(nn.Module):
    def __init__(self, channels: int, heads: int = 2):
        super().__init__()
        self.group_norm = nn.GroupNorm(4, channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.Linear(channels, channels)
        self.heads = heads

    def forward(self, x):
        b, c, h, w = x.shape
        tokens = self.group_norm(x).view(b, c, h * w).transpose(1, 2)
        q, k, v = (proj(tokens).view(b, h * w, self.heads, c // self.heads).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, h * w, c)
        return x + self.to_out(out).transpose(1, 2).reshape(b, c, h, w)


class UNet2D(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(4, 16, 3, padding=1)
        self.time_embedding = TimestepEmbedding(16, 32)
        self.down = ResnetBlock2D(16, 16, 32)
        self.downsample = nn.Conv2d(16, 16, 3, 2, 1)
        self.mid = ResnetBlock2D(16, 32, 32)
        self.mid_attention = SpatialAttention(32)
        self.up = ResnetBlock2D(48, 16, 32)
        self.conv_norm_out = nn.GroupNorm(4, 16)
        self.conv_out = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, sample, timestep):
        temb = self.time_embedding(timestep_embedding(timestep, 16))
        skip = self.down(self.conv_in(sample), temb)
        h = self.mid_attention(self.mid(self.downsample(skip), temb))
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        h = self.up(torch.cat([h, skip], dim=1), temb)
        return self.conv_out(F.silu(self.conv_norm_out(h)))


# -- timm: a ViT (patch embedding, class token, position table, one module called twice) ----


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, classes: int = 10, dim: int = 32):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 8, 8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, 4), Block(dim, 4)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = self.blocks[0](x)  # weights shared across depth (ALBERT-style): the same module twice
        return self.head(self.norm(x)[:, 0])


# -- hand-written: a recurrent tagger (embedding, bidirectional LSTM, GRU, per-token head) -----


class RecurrentTagger(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, tags: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(2 * dim, dim, batch_first=True)
        self.head = nn.Linear(dim, tags)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        out, _ = self.gru(out)
        return torch.log_softmax(self.head(out), dim=-1)


# -- timm: a Swin block (shifted windows through torch.roll, a relative position bias table) --


class WindowAttention(nn.Module):
    def __init__(self, dim: int, window: int, heads: int):
        super().__init__()
        self.window, self.heads = window, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("relative_position_index", relative[..., 0] * (2 * window - 1) + relative[..., 1], persistent=False)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = (attn + bias.permute(2, 0, 1)[None]).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class SwinBlock(nn.Module):
    def __init__(self, dim: int, window: int, shift: int):
        super().__init__()
        self.window, self.shift = window, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, window, 2)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):  # (b, h, w, c)
        b, h, w, c = x.shape
        s, win = self.shift, self.window
        shifted = torch.roll(self.norm1(x), shifts=(-s, -s), dims=(1, 2)) if s else self.norm1(x)
        windows = shifted.view(b, h // win, win, w // win, win, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, win * win, c)
        out = self.attn(windows).view(b, h // win, w // win, win, win, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        x = x + (torch.roll(out, shifts=(s, s), dims=(1, 2)) if s else out)
        return x + self.mlp(self.norm2(x))


class Swin(nn.Module):
    def __init__(self, classes: int = 10, dim: int = 32):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.Sequential(SwinBlock(dim, 4, 0), SwinBlock(dim, 4, 2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.blocks(self.patch_embed(x).permute(0, 2, 3, 1))
        return self.head(self.norm(x).mean((1, 2)))


# -- hand-written: a wav2vec-like audio encoder (Conv1d stack, weight-normed positional conv, --
# -- torch's own TransformerEncoder) ---------------------------------------------------------


class AudioEncoder(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Conv1d(1, dim, 10, 5, bias=False), nn.GroupNorm(dim, dim), nn.GELU(),
            nn.Conv1d(dim, dim, 3, 2, bias=False), nn.GELU(),
        )
        conv = nn.Conv1d(dim, dim, 16, padding=8, groups=4)
        self.pos_conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, waveform):
        features = self.feature_extractor(waveform[:, None])
        features = features + F.gelu(self.pos_conv(features)[:, :, :-1])
        return self.encoder(features.transpose(1, 2))


# -- hand-written: a detection head (top-k queries, gather, box decoding) ---------------------


class DetectionHead(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 6, queries: int = 10):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, dim, 4, 4), nn.ReLU(), nn.Conv2d(dim, dim, 3, padding=1))
        self.class_embed = nn.Linear(dim, classes)
        self.bbox_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 4))
        self.queries = queries

    def forward(self, x):
        memory = self.backbone(x).flatten(2).transpose(1, 2)
        logits = self.class_embed(memory)
        scores, index = logits.max(-1).values.topk(self.queries, dim=1)
        chosen = torch.gather(memory, 1, index[..., None].expand(-1, -1, memory.shape[-1]))
        boxes = self.bbox_embed(chosen).sigmoid()
        return scores, boxes, index


def _image(channels: int = 3, size: int = 32) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, channels, size, size)}


def _init(model: nn.Module) -> nn.Module:
    """Random but not trivial: BatchNorm running statistics away from 0 and 1, so that the
    Conv+BatchNorm folding torch's optimizer does changes real numbers."""
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
    return model.eval()


KINDS = {
    "torchvision_resnet": lambda: (_init(ResNet()), _image()),
    "torchvision_mobilenet_v3": lambda: (_init(MobileNetV3()), _image()),
    "timm_convnext": lambda: (_init(ConvNeXt()), _image()),
    "timm_vit": lambda: (_init(VisionTransformer()), _image()),
    "diffusers_unet": lambda: (_init(UNet2D()), {"sample": torch.randn(2, 4, 16, 16), "timestep": torch.tensor([10.0, 500.0])}),
    "timm_swin": lambda: (_init(Swin()), _image()),
    "audio_encoder": lambda: (_init(AudioEncoder()), {"waveform": torch.randn(2, 400)}),
    "detection_head": lambda: (_init(DetectionHead()), _image()),
    "recurrent_tagger": lambda: (_init(RecurrentTagger()), {"tokens": torch.randint(0, 50, (2, 12))}),
}


def build(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return KINDS[name]()
