"""Small models for the tests: transformers configs with random weights, and hand-made traps."""

from __future__ import annotations

import torch
import torch.nn as nn

# -- transformers ------------------------------------------------------------------


def gpt2(n_layer: int = 2, d: int = 64):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=n_layer, n_embd=d, n_head=4, vocab_size=100, n_positions=64, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2Model(config).eval(), (torch.randint(0, 100, (2, 8)),), {}


def llama(n_layer: int = 2):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False, max_position_embeddings=64,
    )
    return transformers.LlamaModel(config).eval(), (torch.randint(0, 100, (2, 8)),), {}


def llama_lm(n_layer: int = 2):
    """Llama with its LM head and a KV cache (``use_cache=True``)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, use_cache=True, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def llama_kv(n_layer: int = 2):
    """One decode step of :func:`llama_lm`: a new token, the mask, a 3-token ``DynamicCache``."""
    model = llama_lm(n_layer)
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (2, 3)), use_cache=True).past_key_values
    kwargs = dict(
        input_ids=torch.randint(0, 100, (2, 1)), attention_mask=torch.ones(2, 4, dtype=torch.long), past_key_values=cache
    )
    return model, (), kwargs


def bert():
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config).eval(), (torch.randint(0, 100, (2, 8)),), {}


def vit():
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    )
    return transformers.ViTModel(config).eval(), (torch.randn(2, 3, 32, 32),), {}


def t5():
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, use_cache=False,
    )
    kwargs = dict(input_ids=torch.randint(0, 100, (2, 8)), decoder_input_ids=torch.randint(0, 100, (2, 5)))
    return transformers.T5Model(config).eval(), (), kwargs


# -- a ResNet-like conv net (torchvision is not available) ----------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNetLike(nn.Module):
    def __init__(self, widths=(8, 16), blocks_per_stage=2, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers = []
        cin = widths[0]
        for i, width in enumerate(widths):
            blocks = [BasicBlock(cin, width, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(width, width) for _ in range(blocks_per_stage - 1)]
            layers.append(nn.Sequential(*blocks))
            cin = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet():
    torch.manual_seed(0)
    model = ResNetLike().eval()
    # Non-trivial BatchNorm statistics, so that buffers matter numerically.
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 1.5)
    return model, (torch.randn(2, 3, 16, 16),), {}


class Recurrent(nn.Module):
    """A two-layer ``nn.LSTM``, an ``nn.GRU`` and a ``Linear`` head (batch first)."""

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        y, _ = self.lstm(x)
        y, _ = self.gru(y)
        return self.head(y)


def recurrent(features: int = 32, hidden: int = 64):
    torch.manual_seed(0)
    return Recurrent(features, hidden).eval(), (torch.randn(2, 16, features),), {}

# -- traps ---------------------------------------------------------------------------


class Scale(nn.Module):
    def __init__(self, dim: int = 4):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear(x) * 2


class SameInstanceTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = Scale()

    def forward(self, x):
        return self.shared(self.shared(x) + 1)


class SwapWithOps(nn.Module):
    def forward(self, a, b):
        return b * 3, a + 1


class SwapPassThrough(nn.Module):
    def forward(self, a, b):
        return b, a


class SwappedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.swap = SwapWithOps()
        self.pass_through = SwapPassThrough()

    def forward(self, x, y):
        p, q = self.swap(x, y)  # p = y * 3, q = x + 1
        r, s = self.pass_through(p, q)  # r = q, s = p
        return r - s


class ThreeOutputs(nn.Module):
    def forward(self, x):
        return x + 1, x * 2, x - 3


class OutOfOrder(nn.Module):
    def __init__(self):
        super().__init__()
        self.split = ThreeOutputs()

    def forward(self, x):
        first, _, third = self.split(x)
        return third * 10 + first


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = Scale()
        self.ignored = Scale()

    def forward(self, x):
        _ = self.ignored(x)
        return self.used(x)


class KwOnly(nn.Module):
    def forward(self, x, *, gate):
        return x * torch.sigmoid(gate)


class KwargsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.gated = KwOnly()

    def forward(self, x, gate=None):
        return self.gated(x, gate=gate) + 1


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


class CondBranch(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos() - 1, (x,))


class CondNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.branch = CondBranch()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.branch(self.proj(x))


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Scale(), Scale()])
        self.heads = nn.ModuleDict({"left": nn.Linear(4, 2), "right": nn.Linear(4, 3)})
        self.skip = nn.Identity()
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        x = self.dropout(self.skip(x))
        return self.heads["left"](x), self.heads["right"](x)


class Expert(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class HistcRouter(nn.Module):
    """Top-1 routing that counts the tokens per expert with ``histc`` (bin edges 0 .. experts-1);
    ``nudge``: a count ``c > 0`` goes through ``floor(c * (1 - nudge)) + 1`` (exact in float32 for
    a small nudge; a constant ``0.9999`` is ``1.0`` in float16, and every count is one too many)."""

    def __init__(self, d: int, experts: int, nudge: float | None = None):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = experts
        self.nudge = nudge

    def forward(self, x):
        weights, index = self.gate(x).softmax(-1).max(-1)
        counts = torch.histc(index.float(), bins=self.experts, min=0, max=self.experts - 1)
        if self.nudge is not None:
            counts = torch.where(counts > 0, torch.floor(counts * (1 - self.nudge)) + 1, counts)
        return weights, index, counts


class HistcMoE(nn.Module):
    """A mixture of experts that splits the tokens sorted by expert by the router's counts: a count
    off by one (float16 bin edges round: 3.0000002 -> 3.0, before comparisons ran in float32) or
    rounded by float16 elsewhere (``nudge``) makes onnxruntime's Split refuse to run."""

    def __init__(self, d: int = 16, experts: int = 4, nudge: float | None = None):
        super().__init__()
        self.router = HistcRouter(d, experts, nudge)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))

    def forward(self, x):
        weights, index, counts = self.router(x)
        order = torch.argsort(index * x.shape[0] + torch.arange(x.shape[0]))
        tokens = (x * weights.unsqueeze(-1))[order]
        sizes = counts.long().tolist()
        for size in sizes:
            torch._check(size >= 0)
        torch._check(sum(sizes) == tokens.shape[0])
        outputs = torch.cat([expert(part) for expert, part in zip(self.experts, torch.split(tokens, sizes))])
        return torch.empty_like(outputs).index_copy(0, order, outputs)


def histc_moe(nudge: float | None = None):
    torch.manual_seed(0)
    return HistcMoE(nudge=nudge).eval(), (torch.randn(32, 16),), {}


class Twice(nn.Module):
    """A module calling its own ``Scale`` twice (``inner``, ``inner@1``)."""

    def __init__(self):
        super().__init__()
        self.inner = Scale()

    def forward(self, x):
        return self.inner(x) - self.inner(x * 3)


class TwiceTwice(nn.Module):
    """``block`` called twice, each call calling ``block.inner`` twice: call names up to ``@3``."""

    def __init__(self):
        super().__init__()
        self.block = Twice()

    def forward(self, x):
        return self.block(self.block(x) + 1)


class NormAttention(nn.Module):
    """GroupNorm then scaled-dot-product attention over an image's positions, with a residual:
    onnxruntime folds the norm's reshaped weight and the attention's scale into unnamed ``Cast``
    nodes (its profiler names their kernels ``Cast_<index>``)."""

    def __init__(self, channels: int = 32, heads: int = 2):
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.heads = heads

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.norm(x).flatten(2).transpose(1, 2)
        q, k, v = self.qkv(y).view(b, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + o.transpose(1, 2).reshape(b, h * w, c).transpose(1, 2).reshape(b, c, h, w)


class ConvAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 32, 3, padding=1)
        self.attn = NormAttention()

    def forward(self, x):
        return self.attn(self.conv(x))


class Ring(nn.Module):
    """A ring buffer with a write pointer, both registered buffers updated in place by forward."""

    def __init__(self, slots: int = 4, d: int = 8):
        super().__init__()
        self.register_buffer("buf", torch.zeros(slots, d))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.slots = slots

    def forward(self, x):
        self.buf.index_copy_(0, self.ptr.view(1), x)
        self.ptr.add_(1).remainder_(self.slots)
        return self.buf.mean(0, keepdim=True)


class RingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.ring = Ring()

    def forward(self, x):
        return self.lin(self.ring(x) + x)


def ring_net():
    """:class:`RingNet` after two calls (its buffers hold state, the pointer at 2), and an input."""
    torch.manual_seed(0)
    model = RingNet().eval()
    with torch.no_grad():
        model(torch.randn(1, 8))
        model(torch.randn(1, 8))
    return model, (torch.randn(1, 8),), {}


class FusedAndShared(nn.Module):
    """What torch's flat export cannot hand back: a BatchNorm its optimizer fuses into the Conv
    before it (the Conv module is left without nodes), a module called twice (``shared``)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.shared = Scale(8)

    def forward(self, x):
        y = self.bn(self.conv(x)).mean((2, 3))
        return self.shared(self.shared(y) + 1)


class RelativePosition(nn.Module):
    """Gemma 3n audio's relative position term: a projected position table, reshaped per head and
    transposed, multiplies the queries. In float16, onnxruntime 1.32's NCHWc transformer crashes
    (SIGSEGV) creating a session for the ``MatMul -> Reshape -> Transpose -> MatMul`` chain."""

    def __init__(self, width: int = 32, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.pos_proj = nn.Linear(width, width, bias=False)

    def forward(self, queries, table):
        keys = self.pos_proj(table).reshape(table.shape[0], self.heads, -1).permute(1, 2, 0)
        return torch.matmul(queries, keys)


class RelativeAttention(nn.Module):
    """Queries from a projection, scored against a relative position table (``RelativePosition``)."""

    def __init__(self, width: int = 32, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width)
        self.relative = RelativePosition(width, heads)

    def forward(self, x, table):
        batch, length, width = x.shape
        queries = self.q_proj(x).reshape(batch, length, self.heads, width // self.heads).transpose(1, 2)
        return self.relative(queries, table).softmax(-1)


def relative_attention():
    torch.manual_seed(0)
    return RelativeAttention().eval(), (torch.randn(2, 24, 32), torch.randn(13, 32)), {}
