"""Linear kernels: the same products as the model's own layers, installed per layer for
one pass and taken away again."""

import pytest
import torch

from racer.fastpaths import KERNELS
from racer.fastpaths.kernels import LinearKernels, packed_weights, packed_forward, weight_major_forward


class _Head(torch.nn.Module):
    """Two hidden layers and an output layer, like a causal LM's body and head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 6, bias=False))
        self.head = torch.nn.Linear(6, 11, bias=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_weight_major_forward_computes_linear(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 7)
    products = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: products.append((a.shape, b.shape)) or mm(a, b))
    forward = weight_major_forward(layer)
    with torch.inference_mode():
        for x in (torch.randn(3, 5), torch.randn(1, 4, 5), torch.randn(2, 3, 5)):
            products.clear()
            out = forward(x)
            assert products == [((7, 5), (5, x.numel() // 5))]  # the weight on the left: W @ x.T
            assert out.shape == (*x.shape[:-1], 7) and out.is_contiguous()
            torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.bias = None
        x = torch.randn(2, 5)
        torch.testing.assert_close(forward(x), x @ layer.weight.T)


def test_packed_forward_reads_the_packed_copy_until_the_weight_changes(monkeypatch):
    torch.manual_seed(0)
    model = _Head()
    packed = packed_weights(model)
    if packed is None:
        pytest.skip("no oneDNN on this torch build")
    assert set(packed) == {id(m.weight) for m in (model.body[0], model.body[1], model.head)}
    assert packed_weights(model) is packed  # packed once per model
    layer = model.body[0]
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[1]) or pointwise(*a))
    forward = packed_forward(layer, packed[id(layer.weight)])
    with torch.inference_mode():
        for x in (torch.randn(3, 5), torch.randn(1, 4, 5)):
            torch.testing.assert_close(forward(x), layer(x))
        assert calls and all(c is packed[id(layer.weight)][2] for c in calls)
    # A weight changed in place since it was packed is not served from its stale copy.
    with torch.no_grad():
        layer.weight.zero_()
    with torch.inference_mode():
        assert torch.equal(forward(torch.randn(2, 5)), layer.bias.expand(2, 7))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_kernel_is_installed_for_the_block_only_and_computes_the_same(kernel):
    torch.manual_seed(0)
    model = _Head()
    kernels = LinearKernels(model)
    if not kernels.available(kernel):
        pytest.skip("no oneDNN on this torch build")
    x = torch.randn(1, 4, 5)
    with torch.inference_mode():
        want = model(x)
        with kernels.using(kernel):
            installed = {name for name, m in model.named_modules() if "forward" in m.__dict__}
            got = model(x)
        assert not any("forward" in m.__dict__ for m in model.modules())  # taken away again
    assert installed == (set() if kernel == "model" else {"body.0", "body.1", "head"})
    torch.testing.assert_close(got, want)


def test_hybrid_packs_only_the_output_layer(monkeypatch):
    model = _Head()
    kernels = LinearKernels(model)
    if not kernels.available("hybrid"):
        pytest.skip("no oneDNN on this torch build")
    packed = packed_weights(model)
    seen = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: seen.append(a[1]) or pointwise(*a))
    with torch.inference_mode(), kernels.using("hybrid"):
        model(torch.randn(3, 5))
    assert seen == [packed[id(model.head.weight)][2]]


def test_layers_that_are_not_plain_linears_keep_their_own_forward():
    class Quantised(torch.nn.Linear):  # a subclass: its own arithmetic
        pass

    model = _Head()
    model.body[0] = Quantised(5, 7)
    hooked = model.body[1]
    own = hooked.forward
    hooked.forward = own  # an instance forward, as accelerate's hooks install
    with LinearKernels(model).using("weight_major"):
        assert "forward" not in model.body[0].__dict__
        assert hooked.__dict__["forward"] is own
        assert "forward" in model.head.__dict__
    assert hooked.__dict__["forward"] is own  # left as it was


def test_packed_weights_are_refused_where_they_do_not_fit(monkeypatch):
    import racer.fastpaths.kernels as kernels

    monkeypatch.setattr(kernels, "_available_memory", lambda: 100)  # bytes: far less than twice the weights
    assert packed_weights(torch.nn.Linear(5, 7)) is None
    assert packed_weights(torch.nn.Linear(5, 7).to(torch.bfloat16)) is None
    assert not LinearKernels(torch.nn.Linear(5, 7)).available("packed")
    with pytest.raises(ValueError, match="kernel"):
        LinearKernels(torch.nn.Linear(5, 7)).available("fast")


class _Block(torch.nn.Module):
    """Attention-like and MLP-like sibling layers, called as a decoder layer calls them."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, n, bias=bias) for n in (8, 4, 4))
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 12, bias=False), torch.nn.Linear(8, 12, bias=False)
        self.down_proj = torch.nn.Linear(12, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        x = x + q + torch.cat([k, v], -1)
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("bias", [False, True])
def test_packed_siblings_are_one_product_with_the_separate_products_bits(monkeypatch, bias):
    import racer.fastpaths.kernels as kernels

    torch.manual_seed(0)
    model = _Block(bias)
    if packed_weights(model) is None:
        pytest.skip("no oneDNN on this torch build")
    groups = kernels.packed_siblings(model)
    if not groups:
        pytest.skip("this machine's side-by-side products differ from the separate ones")
    assert [g.layers for g in groups] == [(model.q_proj, model.k_proj, model.v_proj), (model.gate_proj, model.up_proj)]
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[1]) or pointwise(*a))
    x = torch.randn(1, 5, 8)
    with torch.inference_mode():
        want = model(x)
        with LinearKernels(model).using("packed"):
            got = model(x)
        assert calls == [groups[0].packed, groups[1].packed, packed_weights(model)[id(model.down_proj.weight)][2]]
        assert all(g.input is None for g in groups)  # nothing held past the pass
        torch.testing.assert_close(got, want)
        # Bit for bit what separate packed products give, of which none is kept.
        assert all(id(layer.weight) not in packed_weights(model) for g in groups for layer in g.layers)
        flat = x.reshape(-1, 8)
        for group in groups:
            for i, layer in enumerate(group.layers):  # the first computes, the others take what it kept
                apart = pointwise(flat, kernels._pack(layer.weight), layer.bias, "none", [], "")
                assert torch.equal(group.forward_of(i)(flat), apart)
            group.clear()


def test_a_sibling_called_on_another_input_or_after_a_weight_change_gets_its_own_product():
    from racer.fastpaths.kernels import packed_siblings

    torch.manual_seed(0)
    model = _Block()
    if packed_weights(model) is None or not packed_siblings(model):
        pytest.skip("no oneDNN, or side-by-side products differ here")
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad(), LinearKernels(model).using("packed"):  # no_grad: torch counts in-place changes
        model.q_proj(a)
        torch.testing.assert_close(model.k_proj(b), b @ model.k_proj.weight.T)  # not a's kept output
        model.q_proj(a)
        a.mul_(2)  # changed in place since the product: the kept outputs are stale
        torch.testing.assert_close(model.v_proj(a), a @ model.v_proj.weight.T)
    with torch.no_grad():
        model.up_proj.weight.mul_(3)
    with torch.no_grad(), LinearKernels(model).using("packed"):
        model.gate_proj(a)
        torch.testing.assert_close(model.up_proj(a), a @ model.up_proj.weight.T)
