"""Meshes as JAX makes them: `Explicit`, `Auto` and mixed axis types.

`jax.make_mesh` gives `Explicit` axes by default (JAX 0.10), where an array's
layout is part of its type. Every blocklab entry point that takes a mesh
takes one of any axis types and computes what one device computes:

- `shard`, for every rules preset, on `Auto`, `Explicit` and both mixed
  orders of axis types: the arrays lie on the mesh given, with the layout
  the rules give on an `Auto` mesh, and the forward (inside
  `jax.sharding.auto_axes`, as `shard` documents) equals the one-device
  logits; a forward outside it is refused by name;
- `train_model` (the issue's `jax.make_mesh((8,), ("data",))` with `"fsdp"`),
  `save_sharded` from that mesh and `restore_sharded` onto a mixed mesh
  under `"fsdp+tp"`, resumed: the losses of one device;
- `sharded_map`, and the checkpoint checksum on every layout.

The 8 simulated devices run in a fresh process (the device count is fixed
when JAX starts). Losses and logits agree with one device to float32
rounding (a split contraction sums in another order): relative 1e-5.
"""

import textwrap

import jax
import numpy as np
import pytest
from _procs import script_json
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from blocklab import CharLM, ConfigError, DecoderConfig, DecoderLM
from blocklab.training.placement import auto_mesh, check_mesh, on_mesh, shard

COMMON = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from blocklab.models import DecoderConfig, DecoderLM, MoEDecoderConfig

    E, A = AxisType.Explicit, AxisType.Auto
    KINDS = {"auto": (A, A), "explicit": (E, E), "mixed": (E, A), "mixed2": (A, E)}

    def make_mesh(shape, names, kind):
        return jax.make_mesh(shape, names, axis_types=KINDS[kind][: len(shape)])

    # Sizes divide every mesh below: width 32 over data=8, 4 heads / 2 KV
    # heads and FFN 64 over model=4, 4 experts over expert=4.
    DENSE = DecoderLM(DecoderConfig.llama(
        vocab_size=32, num_hiddens=32, num_heads=4, num_blks=1, num_kv_heads=2,
        ffn_width=64, max_len=16), key=jax.random.key(0))
    MOE = DecoderLM(MoEDecoderConfig(
        32, 32, 4, 1, num_kv_heads=2, num_experts=4, top_k=2, max_len=16),
        key=jax.random.key(0))
    #: rules -> (model, mesh shape, axis names)
    PRESETS = {
        "dp": ("dense", (8,), ("data",)),
        "fsdp": ("dense", (8,), ("data",)),
        "tp": ("dense", (2, 4), ("data", "model")),
        "fsdp+tp": ("dense", (2, 4), ("data", "model")),
        "ep": ("moe", (2, 4), ("data", "expert")),
        "fsdp+ep": ("moe", (2, 4), ("data", "expert")),
    }
    MODELS = {"dense": DENSE, "moe": MOE}
    #: the axis types each preset is tried on (both mixed orders once)
    KINDS_OF = {r: ["auto", "explicit"] + (["mixed"] if len(s) > 1 else [])
                for r, (_, s, _) in PRESETS.items()}
    KINDS_OF["fsdp+tp"].append("mixed2")

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    """
)

SHARD = COMMON + textwrap.dedent(
    """
    from blocklab.training.member_axis import sharded_map
    from blocklab.training import sharded_checkpoint as sc
    from blocklab.training.placement import shard

    ids = (np.arange(8 * 16).reshape(8, 16) % 28).astype(np.int32)
    # one device: the model's arrays are on device 0, no mesh
    ref = {k: np.asarray(jax.jit(jax.vmap(m))(ids)) for k, m in MODELS.items()}
    out = {"checksums": {}}
    for rules, (kind, shape, names) in PRESETS.items():
        model = MODELS[kind]
        flat = jax.tree_util.tree_leaves(model)
        for mk in KINDS_OF[rules]:
            mesh = make_mesh(shape, names, mk)
            s = shard(model, mesh, rules)
            leaves = jax.tree_util.tree_leaves(s)
            with jax.set_mesh(mesh):
                fwd = jax.sharding.auto_axes(lambda m, x: jax.vmap(m)(x),
                                             out_sharding=P())
                logits = jax.jit(fwd)(s, ids)
            out[f"{rules}/{mk}"] = {
                "meshes": sorted({str(x.sharding.mesh) for x in leaves}),
                "mesh": str(mesh),
                "specs": [str(x.sharding.spec) for x in leaves],
                "equal": all(np.array_equal(np.asarray(a), np.asarray(b))
                             for a, b in zip(flat, leaves, strict=True)),
                "logits_err": rel(logits, ref[kind]),
            }
            if (rules, mk) in (("fsdp", "explicit"), ("fsdp+tp", "mixed2")):
                named = [(str(i), x) for i, x in enumerate(leaves)]
                out["checksums"][f"{rules}/{mk}"] = sc._checksums(named)
    out["checksums"]["one device"] = sc._checksums(
        [(str(i), x) for i, x in enumerate(jax.tree_util.tree_leaves(DENSE))])

    # sharded_map over an Explicit members axis: the members of the default mesh
    def fn(key, scale):
        return scale * jax.random.normal(key, (3,))
    scales = np.arange(1.0, 4.0, dtype=np.float32)
    out["map"] = [np.asarray(sharded_map(fn, [0, 1, 2], scales, mesh=m)).tolist()
                  for m in (None, jax.make_mesh((8,), ("members",)))]
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # kept out of the default run for CI time
def test_shard_on_every_axis_type_lays_out_and_computes_as_one_device():
    res = script_json(SHARD, devices=8, timeout=600)
    presets = ("dp", "fsdp", "tp", "fsdp+tp", "ep", "fsdp+ep")
    tried = {k.split("/")[0] for k in res if "/" in k}
    assert tried == set(presets), tried
    for rules in presets:
        kinds = ["auto", "explicit"] + (
            ["mixed"] if rules not in ("dp", "fsdp") else []
        )
        kinds += ["mixed2"] if rules == "fsdp+tp" else []
        auto = res[f"{rules}/auto"]
        for kind in kinds:
            got = res[f"{rules}/{kind}"]
            where = f"{rules} on {got['mesh']}"
            # on the mesh given (its axis types kept), laid out as on Auto axes
            assert got["meshes"] == [got["mesh"]], where
            assert got["specs"] == auto["specs"], where
            assert got["equal"], where
            assert got["logits_err"] < 1e-5, (where, got["logits_err"])
        if rules != "dp":  # the rules split something
            assert any(s != "P()" for s in auto["specs"]), rules
    assert "Explicit" in res["fsdp/explicit"]["mesh"]
    assert "axis_types=(Explicit, Auto)" in res["tp/mixed"]["mesh"]
    # the checksum of every array does not depend on its layout
    one = res["checksums"].pop("one device")
    assert len(res["checksums"]) == 2
    for layout, sums in res["checksums"].items():
        assert sums == one, layout
    a, b = res["map"]
    np.testing.assert_array_equal(a, b)


TRAIN = COMMON + textwrap.dedent(
    """
    import equinox as eqx
    from blocklab.data import TimeMachine
    from blocklab.training.placement import on_mesh
    from blocklab.training.run import train_model
    from blocklab import RunConfig, SweepConfig
    from blocklab.training.sharded_checkpoint import restore_sharded, save_sharded

    path = sys.argv[1]
    data = TimeMachine(seq_len=16, num_train=500, num_val=0)
    opt = optax.adam(3e-3)

    def train(n, mesh=None, rules=None, **kw):
        return train_model(kw.pop("model", None), data, opt, n,
                           key=jax.random.key(1), **kw,
                           run=RunConfig(batch_size=8, steps_per_call=2,
                                         progress=False, mesh=mesh, rules=rules))

    out = {}
    one = train(4, model=DENSE)
    out["one"] = one.losses.tolist()
    # the issue's mesh: jax.make_mesh's default axis types are Explicit
    mesh = jax.make_mesh((8,), ("data",))
    out["types"] = str(mesh.axis_types)
    half = train(2, mesh, "fsdp", model=DENSE)
    out["half"] = half.losses.tolist()
    # the state handed back onto the mesh given: no copy, the same layout
    back = on_mesh(half.state, mesh)
    pairs = list(zip(jax.tree_util.tree_leaves(half.state),
                     jax.tree_util.tree_leaves(back), strict=True))
    out["on_mesh"] = all(
        b.sharding == NamedSharding(mesh, a.sharding.spec)
        and a.addressable_shards[0].data.unsafe_buffer_pointer()
        == b.addressable_shards[0].data.unsafe_buffer_pointer()
        for a, b in pairs if a.ndim)
    save_sharded(path, back)
    # restored onto a mixed mesh under other rules, and resumed there
    mixed = make_mesh((2, 4), ("data", "model"), "mixed")
    shape = eqx.filter_eval_shape(lambda: DENSE)
    state = restore_sharded(path, shape, opt, mesh=mixed, rules="fsdp+tp")
    w = state.model.stack.blocks.attention.W_q.weight
    out["restored"] = [str(w.sharding.mesh), str(w.sharding.spec)]
    out["restored_equal"] = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree_util.tree_leaves(half.state),
                        jax.tree_util.tree_leaves(state), strict=True))
    out["resumed"] = train(2, mixed, "fsdp+tp", state=state).losses.tolist()
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # kept out of the default run for CI time (~20 s)
def test_train_save_restore_resume_on_explicit_and_mixed_meshes(tmp_path):
    """`train_model(..., mesh=jax.make_mesh((8,), ("data",)), rules="fsdp")`
    failed inside `with_sharding_constraint` ("can only refer to Auto axes")."""
    res = script_json(TRAIN, str(tmp_path / "ck"), devices=8, timeout=600)
    assert res["types"] == "(Explicit,)"
    one = np.asarray(res["one"])
    np.testing.assert_allclose(res["half"], one[:2], rtol=1e-5, atol=0)
    assert res["on_mesh"]
    assert res["restored"] == [
        "Mesh('data': 2, 'model': 4, axis_types=(Explicit, Auto))",
        "P(None, 'model', 'data')",
    ]
    assert res["restored_equal"]
    np.testing.assert_allclose(res["resumed"], one[2:], rtol=1e-5, atol=0)


SLOW = COMMON + textwrap.dedent(
    """
    from blocklab.data import TimeMachine
    from blocklab.training.run import train_model
    from blocklab import RunConfig, SweepConfig

    data = TimeMachine(seq_len=16, num_train=500, num_val=40)

    def train(model, mesh=None, rules=None):
        r = train_model(model, data, optax.adam(3e-3), 4, key=jax.random.key(1),
                        run=RunConfig(batch_size=8, steps_per_call=2,
                                      progress=False, mesh=mesh, rules=rules))
        return r

    one = {k: train(m) for k, m in MODELS.items()}
    out = {k: [r.losses.tolist(), r.val_loss] for k, r in one.items()}
    for rules, (kind, shape, names) in PRESETS.items():
        for mk in list(KINDS)[: 2 if len(shape) == 1 else 4]:
            mesh = make_mesh(shape, names, mk)
            r = train(MODELS[kind], mesh, rules)
            out[f"{rules}/{mk}"] = [r.losses.tolist(), r.val_loss]
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_train_model_with_every_preset_on_every_axis_type_equals_one_device():
    res = script_json(SLOW, devices=8, timeout=1800)
    for key, (losses, val) in res.items():
        if "/" not in key:
            continue
        kind = "moe" if "ep" in key.split("/")[0] else "dense"
        np.testing.assert_allclose(losses, res[kind][0], rtol=1e-5, atol=0)
        np.testing.assert_allclose(val, res[kind][1], rtol=1e-5, atol=0)
    assert len(res) == 2 + 2 * 2 + 4 * 4


HANDED_BACK = COMMON + textwrap.dedent(
    """
    from blocklab.data import TimeMachine
    from blocklab.training.run import train_model
    from blocklab import RunConfig, SweepConfig
    from blocklab.training.sweep import train_sweep

    data = TimeMachine(seq_len=16, num_train=500, num_val=40)
    out = {}
    for mk in ("none", "explicit", "mixed"):
        mesh = None if mk == "none" else make_mesh((2, 4), ("members", "data"), mk)
        r = train_sweep(lambda k: DecoderLM(DENSE.cfg, key=k), data, 2,
                        model_keys=[0, 1], data_keys=[5, 6],
                        run=RunConfig(batch_size=8, steps_per_call=2,
                                      progress=False, mesh=mesh),
                        sweep=SweepConfig(learning_rates=[1e-3, 3e-3]))
        w = r.state.model.stack.blocks.attention.W_q.weight
        out[mk] = [r.losses.tolist(), r.val_loss.tolist(), str(w.sharding.mesh)]
    mesh = jax.make_mesh((8,), ("data",))
    r = train_model(DENSE, data, optax.adam(3e-3), 2, key=jax.random.key(1),
                    run=RunConfig(batch_size=8, steps_per_call=2, progress=False,
                                  mesh=mesh))
    out["train_model"] = sorted({str(a.sharding.mesh)
                                 for a in jax.tree_util.tree_leaves(r.state)})
    out["mesh"] = str(mesh)
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_train_sweep_on_explicit_meshes_and_states_handed_back_on_the_mesh_given():
    res = script_json(HANDED_BACK, devices=8, timeout=1200)
    for mk in ("explicit", "mixed"):
        np.testing.assert_allclose(res[mk][0], res["none"][0], rtol=1e-5, atol=0)
        np.testing.assert_allclose(res[mk][1], res["none"][1], rtol=1e-5, atol=0)
    assert res["explicit"][2].endswith("axis_types=(Explicit, Explicit))")
    assert res["mixed"][2].endswith("axis_types=(Explicit, Auto))")
    assert res["train_model"] == [res["mesh"]]


# -- one device, in this process ------------------------------------------------


def _one_device_mesh(axis_type):
    return jax.make_mesh((1,), ("data",), axis_types=(axis_type,))


def test_a_forward_outside_auto_axes_on_explicit_axes_is_refused_by_name():
    cfg = DecoderConfig.llama(
        vocab_size=32, num_hiddens=32, num_heads=4, num_blks=1, num_kv_heads=2,
        ffn_width=64, max_len=16,
    )  # fmt: skip
    model = DecoderLM(cfg, key=jax.random.key(0))
    mesh = _one_device_mesh(AxisType.Explicit)
    sharded = shard(model, mesh, "fsdp")
    ids = np.arange(16, dtype=np.int32) % 28
    with pytest.raises(
        ConfigError,
        match=r"typed by the Explicit mesh axes \['data'\].*jax.sharding.auto_axes",
    ):
        jax.jit(lambda m: m(ids))(sharded)
    with jax.set_mesh(mesh):
        fwd = jax.sharding.auto_axes(lambda m: m(ids), out_sharding=PartitionSpec())
        got = jax.jit(fwd)(sharded)
    np.testing.assert_allclose(got, jax.jit(lambda m: m(ids))(model), rtol=1e-6)


def test_auto_mesh_keeps_devices_and_names_and_makes_explicit_axes_auto():
    E, A = AxisType.Explicit, AxisType.Auto
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(E, A))
    view = auto_mesh(mesh)
    assert view.axis_types == (A, A)
    assert view.axis_names == mesh.axis_names
    assert (view.devices == mesh.devices).all()
    auto = jax.make_mesh((1,), ("data",), axis_types=(A,))
    assert auto_mesh(auto) is auto
    abstract = mesh.abstract_mesh
    assert auto_mesh(abstract).axis_types == (A, A)


def test_on_mesh_puts_arrays_back_without_copying():
    mesh = _one_device_mesh(AxisType.Explicit)
    x = jax.device_put(np.arange(6.0).reshape(2, 3), NamedSharding(auto_mesh(mesh),
                       PartitionSpec("data")))  # fmt: skip
    tree = {"x": x, "n": 3, "y": None}
    back = on_mesh(tree, mesh)
    assert back["x"].sharding == NamedSharding(mesh, PartitionSpec("data"))
    assert (
        back["x"].addressable_shards[0].data.unsafe_buffer_pointer()
        == x.addressable_shards[0].data.unsafe_buffer_pointer()
    )
    assert back["n"] == 3 and back["y"] is None
    # an array on another mesh (other names) is left as it is
    other = Mesh(np.asarray(jax.devices()[:1]), ("members",))
    z = jax.device_put(np.ones(2), NamedSharding(other, PartitionSpec()))
    assert on_mesh(z, mesh) is z


@pytest.mark.parametrize(
    "mesh, match",
    [
        (None, r"shard: mesh must be a jax.sharding.Mesh, got None \(NoneType\)"),
        ("data=1", r"shard: mesh must be a jax.sharding.Mesh, got 'data=1' \(str\)"),
        ("manual", r"shard: mesh axis 'data' of mesh \{'data': 1\} has axis type "),
    ],
)
def test_shard_refuses_what_is_not_a_mesh_of_auto_or_explicit_axes(
    mesh, match, plain_python
):
    # plain_python: blocklab's own error, not the annotation's (as a user runs)
    if mesh == "manual":
        mesh = _one_device_mesh(AxisType.Manual)
    model = CharLM(28, 16, 2, 1, key=jax.random.key(0))
    with pytest.raises(ConfigError, match=match):
        shard(model, mesh, "fsdp")
    with pytest.raises(
        ConfigError, match="restore_sharded" + match.removeprefix("shard")
    ):
        check_mesh(mesh, _owner="restore_sharded")
