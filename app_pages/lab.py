"""The Lab: a real small experiment on this machine's CPU (or GPUs), any layout the engine runs, each run
verified, predicted and kept in a table for this browser session."""

from dataclasses import replace

import streamlit as st

from app_pages.link_params import drop_from_link, link_values
from app_pages.live_panel import run_live, show_live
from core.timeline import strict_json
from engine.cli import argv_for, command_line
from engine.config import ConfigError, ModelConfig, validate
from engine.predict import cached_calibration
from hardware.this_machine import gpus
from server.queue import Refused, get_queue
from server.settings import SettingsError
from ui.lab import (
    LAB_CHOICES,
    LAB_NUMBERS,
    LAB_PARAMS,
    LAB_PRESETS,
    LAB_TEXTS,
    LAB_TITLES,
    compare_figures,
    lab_config,
    lab_label,
    lab_link_problems,
    lab_numbers,
    lab_words,
    mesh_label,
    repeated_link_message,
    results_json,
    run_rows,
    torchrun_command,
)
from ui.state import ignored_link_message, inert_markdown, link_value
from ui.tables import count, shell_lines

st.title("The Lab")
st.markdown(
    "Try a layout for real before you spend a cluster on it. Choose a small model, a mesh over any of the "
    "engine's axes, a pipeline schedule and the batch; **Run** trains it on real processes of this machine "
    "with `torch.distributed`, checks loss, gradients, weights and optimizer state against a single-process "
    "run, and shows the measured step beside the planner's prediction for this machine. Every run of this "
    "session is kept in the table below, where two of them can be compared step against step."
)

# A shared link carries every control below (bound to the query parameter of its key). What a control cannot
# take is said and taken out of the link before the controls read it, so none of them guesses.
found = gpus()
devices = ["cpu"] + (["cuda"] if found else [])
try:  # the Steps box goes up to this server's SHARDLAB_MAX_STEPS (a raised limit had stopped at the box's 20)
    numbers = lab_numbers(get_queue().settings.max_steps)
except SettingsError:  # a misconfigured server is said where the run is ("About this server")
    numbers = lab_numbers()
lab_link = {k: st.query_params.get_all(k) for k in st.query_params if k in LAB_PARAMS}  # others: the app's message
bad_link = lab_link_problems(lab_link, devices, numbers)
# a text box takes a long text from the link cut to its length, whatever the page does: said, not dropped
cut = {k: bad_link.pop(k) for k in LAB_TEXTS if k in bad_link}
if repeated := repeated_link_message({k: v for k, v in lab_link.items() if k not in bad_link}):
    st.info(repeated, icon=":material/link:")
if bad_link:
    st.info(ignored_link_message(bad_link, link_values()), icon=":material/link_off:")
    for key in bad_link:
        drop_from_link(key)
for key, what in cut.items():
    st.warning(f"The link's {key}={link_value(st.query_params[key])} is longer than the box takes ({what}): "
               f"the box keeps its first {LAB_NUMBERS['lab_layers'][1]}. Check the pattern before you run.",
               icon=":material/content_cut:")


def _number(col, label: str, key: str, **kwargs):
    """A whole-number box of the Lab, its range from ui/lab.lab_numbers, bound to the link."""
    low, high, step = numbers[key]
    return col.number_input(label, low, high, step=step, key=key, bind="query-params", **kwargs)


def _choice(col, label: str, key: str, options=None, **kwargs):
    """A selectbox of the Lab, its options from ui/lab.LAB_CHOICES labelled as a link writes them."""
    return col.selectbox(label, list(options or LAB_CHOICES[key]), key=key, bind="query-params",
                         format_func=lambda o: lab_label(key, o), **kwargs)


st.subheader("Model")
presets = LAB_PRESETS
# Each model widget's key and the ModelConfig field it sets: choosing a preset loads all of them.
MODEL_WIDGETS = {"lab_arch": "arch", "lab_pattern": "pattern", "lab_ssm_state": "ssm_state",
                 "lab_ssm_groups": "ssm_groups", "lab_ssm_chunk": "ssm_chunk", "lab_layers": "layers",
                 "lab_hidden": "hidden", "lab_heads": "heads", "lab_kv_heads": "kv_heads", "lab_ffn": "ffn",
                 "lab_vocab": "vocab", "lab_seq": "seq_len", "lab_mlp": "mlp", "lab_experts": "experts",
                 "lab_top_k": "top_k"}


def _load_preset() -> None:
    chosen = presets[st.session_state["lab_preset"]]
    for key, name in MODEL_WIDGETS.items():
        st.session_state[key] = getattr(chosen, name)


# A link that names a preset and none of its fields (written by hand: the page's own links carry every field
# that differs) loads it, as choosing it would: a link's value reaches the box without its on_change.
linked = st.query_params.to_dict()
if ("lab_preset_from_link" not in st.session_state and linked.get("lab_preset") in presets
        and not set(MODEL_WIDGETS) & set(linked)):
    st.session_state["lab_preset"] = linked["lab_preset"]
    _load_preset()
st.session_state["lab_preset_from_link"] = True
st.selectbox("Start from", list(presets), key="lab_preset", on_change=_load_preset, bind="query-params",
             help="loads the preset's values into every model field below")
# A fresh session starts from the first preset: each model box's default is its value, so a link leaves out
# exactly the values the first preset has (a bound widget at its default is not written to the link).
first = next(iter(presets.values()))


def _model_number(col, label: str, key: str, **kwargs):
    return _number(col, label, key, value=getattr(first, MODEL_WIDGETS[key]), **kwargs)

# The architecture on a row of its own: in a fifth of a 1,024-px window a selectbox cut "transformer" short. A
# radio takes the same link value (the option's label) and shows the three at once.
arch = st.radio(LAB_TITLES["lab_arch"], LAB_CHOICES["lab_arch"], horizontal=True, key="lab_arch",
                bind="query-params", format_func=lambda o: lab_label("lab_arch", o),
                help="transformer: attention + MLP blocks; mamba2: Mamba-2 blocks (no MLP); hybrid: both, "
                     "one letter per layer in the pattern")
c = st.columns(4)
pattern = c[0].text_input(LAB_TITLES["lab_pattern"], key="lab_pattern", disabled=arch != "hybrid", bind="query-params",
                          max_chars=LAB_NUMBERS["lab_layers"][1],
                          help="hybrid only: one letter per layer, A attention or M Mamba-2; empty: M and A "
                               "alternating")
ssm_state = _model_number(c[1], LAB_TITLES["lab_ssm_state"], "lab_ssm_state", disabled=arch == "transformer")
ssm_groups = _model_number(c[2], LAB_TITLES["lab_ssm_groups"], "lab_ssm_groups", disabled=arch == "transformer",
                           help="groups of Mamba-2 heads sharing B and C; tensor parallel needs tp to divide it")
ssm_chunk = _model_number(c[3], LAB_TITLES["lab_ssm_chunk"], "lab_ssm_chunk", disabled=arch == "transformer",
                          help="the chunked scan's chunk length; divides the sequence (and each context-parallel "
                               "slice)")
# the boxes level at the bottom: at 800 px "Attention heads" and "Sequence length" wrap and had pushed their
# boxes below the row's others; the MLP choice wider, as at 800 px it read "dens"
c = st.columns(5, vertical_alignment="bottom")
layers = _model_number(c[0], LAB_TITLES["lab_layers"], "lab_layers")
hidden = _model_number(c[1], LAB_TITLES["lab_hidden"], "lab_hidden")
heads = _model_number(c[2], LAB_TITLES["lab_heads"], "lab_heads")
kv_heads = _model_number(c[3], LAB_TITLES["lab_kv_heads"], "lab_kv_heads",
                         help="grouped-query attention: each KV head serves heads / kv_heads query heads")
ffn = _model_number(c[4], LAB_TITLES["lab_ffn"], "lab_ffn")
c = st.columns([1, 1, 1.5, 1, 1], vertical_alignment="bottom")
vocab = _model_number(c[0], LAB_TITLES["lab_vocab"], "lab_vocab")
seq_len = _model_number(c[1], LAB_TITLES["lab_seq"], "lab_seq")
mlp = _choice(c[2], LAB_TITLES["lab_mlp"], "lab_mlp")
experts = _model_number(c[3], LAB_TITLES["lab_experts"], "lab_experts", disabled=mlp != "moe")
top_k = _model_number(c[4], LAB_TITLES["lab_top_k"], "lab_top_k", disabled=mlp != "moe")
unset = ModelConfig()  # a greyed-out field's value does not count: the default stands
moe, ssm = mlp == "moe", arch != "transformer"
model = ModelConfig(layers=int(layers), hidden=int(hidden), heads=int(heads), kv_heads=int(kv_heads), ffn=int(ffn),
                    vocab=int(vocab), seq_len=int(seq_len), mlp=mlp,
                    experts=int(experts) if moe else unset.experts, top_k=int(top_k) if moe else unset.top_k,
                    arch=arch, pattern=pattern.strip().upper() if arch == "hybrid" else "",
                    ssm_state=int(ssm_state) if ssm else unset.ssm_state,
                    ssm_groups=int(ssm_groups) if ssm else unset.ssm_groups,
                    ssm_chunk=int(ssm_chunk) if ssm else unset.ssm_chunk)

st.subheader("Mesh and schedule")
st.caption("Any combination of the axes runs: ranks are laid out pp, dp, fsdp, cp, ep, tp with tp innermost "
           "(consecutive ranks), whatever you set first; the number of processes is the product of the degrees. "
           "dp, fsdp and ep ranks read different sequences, cp ranks different positions of them. Each axis takes "
           "1 to 8 ranks: a number typed above 8 is not taken (the box marks it), the run keeps the last one taken.")
axis_help = {"pp": "pipeline stages", "dp": "data-parallel replicas (with fsdp too: HSDP, replicas of the shards)",
             "fsdp": "data-parallel ranks that ZeRO shards over (stage 3 unless you choose 1 or 2)",
             "cp": "context parallel: the sequence split, K/V passed around a ring (Mamba-2: states passed on)",
             "ep": "expert parallel: experts split, tokens sent by all-to-all (needs the MoE MLP)",
             "tp": "tensor parallel: heads and MLP columns split"}
c = st.columns(6)
mesh = {axis: int(_number(col, axis, f"lab_{axis}", value=2 if axis == "dp" else 1, help=axis_help[axis]))
        for col, axis in zip(c, ("pp", "dp", "fsdp", "cp", "ep", "tp"), strict=True)}
# three a row, the toggle on a line of its own: in a quarter of a 1,024-px window "interleaved-1f1b" was cut,
# and the toggle's title (never wrapped, cut to fit) read "Sequence pa..."
c = st.columns(3)
zero_stage = _choice(c[0], LAB_TITLES["lab_zero"], "lab_zero",
                     help="over the data axes: 0 replicates; 1 shards Adam's state, 2 also the gradients, "
                                 "3 also the weights, over fsdp when the mesh has it, else over dp (the other "
                                 "data axes keep replicas of the shards)")
schedule = _choice(c[1], LAB_TITLES["lab_schedule"], "lab_schedule", disabled=mesh["pp"] == 1)
virtual = _number(c[2], LAB_TITLES["lab_virtual"], "lab_virtual", value=1,
                  disabled=mesh["pp"] == 1 or schedule != "interleaved-1f1b")
sequence_parallel = st.toggle(LAB_TITLES["lab_sp"], key="lab_sp", disabled=mesh["tp"] == 1, bind="query-params")
ssm_cp = st.radio(LAB_TITLES["lab_ssm_cp"], LAB_CHOICES["lab_ssm_cp"], horizontal=True, key="lab_ssm_cp",
                  disabled=mesh["cp"] == 1 or arch == "transformer", bind="query-params",
                  format_func=lambda o: lab_label("lab_ssm_cp", o))

st.subheader("Batch and steps")
# two rows of three: five a row cut "bf16 mixed precision" short in a 1,024-px window; the boxes level at the
# bottom ("Sequences per micro-batch" wraps at 800 px and had pushed its box below its neighbours')
c = st.columns(3, vertical_alignment="bottom") + st.columns(3, vertical_alignment="bottom")
# a default that no other control moves: a link leaves a box out when it is at its default, and a default
# that followed pp (2 with a pipeline) made the teacher's 1 and the student's 2 the same link
micro_batches = _number(c[0], LAB_TITLES["lab_mb"], "lab_mb", value=1)
micro_batch_size = _number(c[1], LAB_TITLES["lab_mbs"], "lab_mbs", value=2)
most_steps = numbers["lab_steps"][1]
steps = _number(c[2], LAB_TITLES["lab_steps"], "lab_steps", value=min(3, most_steps),
                help=f"at most {most_steps:,}: this server's limit (SHARDLAB_MAX_STEPS, set by whoever runs it)")
dtype = _choice(c[3], LAB_TITLES["lab_dtype"], "lab_dtype",
                help="fp32: checked to fp32 rounding. bf16: matmuls in bf16, weights, gradients and Adam "
                            "state in fp32 (mixed precision), checked against a single-process bf16 run with "
                            "bf16's tolerances (engine/verify.py); not with MoE layers, and not predicted.")
device = _choice(c[4], LAB_TITLES["lab_device"], "lab_device", options=devices,
                 help="cuda: NCCL when each rank has its own GPU, otherwise GPU compute with gloo")
if found:
    st.caption("GPUs here: " + "; ".join(f"{name} ({gib:,.0f} GiB)" for name, gib in found))
else:
    st.caption("No NVIDIA GPU found on this machine (nvidia-smi): runs use CPU processes.")

interleaved = mesh["pp"] > 1 and schedule == "interleaved-1f1b"  # a greyed-out control's value does not count
cfg = lab_config(model, mesh, int(zero_stage), schedule, int(virtual) if interleaved else 1, int(micro_batches),
                 int(micro_batch_size), int(steps), device, dtype)
if sequence_parallel and mesh["tp"] > 1:
    cfg = replace(cfg, parallel=replace(cfg.parallel, sequence_parallel=True))
if mesh["cp"] > 1 and arch != "transformer":  # else greyed out: the default stays
    cfg = replace(cfg, parallel=replace(cfg.parallel, ssm_cp=ssm_cp))
label = f"run {len(st.session_state.get('lab_runs', [])) + 1}"
problem = None
try:
    validate(cfg)
    get_queue().check([(label, cfg)])  # the server's caps too (server/queue.py): said now, not at Run
except (ConfigError, Refused) as e:
    problem = str(e)
except SettingsError:
    pass  # a misconfigured server: "About this server" below says so
if mesh["pp"] > 1 and micro_batches < mesh["pp"]:
    st.caption(f"With {count(int(micro_batches), 'micro-batch')} through {mesh['pp']} stages, each stage waits for "
               f"the others most of the step (the bubble is (p - 1) / (m + p - 1) = "
               f"{(mesh['pp'] - 1) / (micro_batches + mesh['pp'] - 1):.0%} of it): raise Micro-batches to see the "
               "stages overlap.")
st.markdown((f"**{mesh_label(cfg)}** on **{cfg.world} processes**, " if cfg.world > 1 else "**One process**, ")
            + f"{cfg.model.params:,} parameters, {cfg.global_batch} sequences per step.")
if problem:
    st.error(f"This layout cannot run: {lab_words(inert_markdown(problem))}.", icon=":material/block:")

if st.button("Run this experiment", type="primary", disabled=problem is not None):
    run_live("lab_current", [(label, cfg)], hint="try fewer processes, steps or a smaller model")
current = show_live("lab_current")
history = st.session_state.setdefault("lab_runs", [])
if current and (not history or current[0] is not history[-1]):
    history.append(current[0])

st.subheader("The same experiment elsewhere")
try:  # with this server's time limit, as the run above gets it: one command everywhere
    as_run = get_queue().as_run(cfg)
except SettingsError:  # a misconfigured server is said where the run is; the command stands without it
    as_run = cfg
if current and command_line(current[0].cfg) == command_line(as_run):  # the panel just showed it: not twice
    st.markdown("From a terminal in this repository: the command under the run above (`--json` prints every "
                "number of the table, `--trace` writes the timeline).")
else:
    st.markdown("From a terminal in this repository (`--json` prints every number of the table, `--trace` "
                "writes the timeline):")
    st.code(shell_lines(command_line(as_run)), language="bash", wrap_lines=True)
st.markdown("Across machines with `torchrun` (each machine runs it with its node rank; HOST0 is node 0's "
            "address):")
st.code(shell_lines(torchrun_command(as_run, argv_for(as_run))), language="bash", wrap_lines=True)

st.subheader("This session's runs")
if not history:
    st.caption("No run yet: press Run above. Runs stay here until you close the tab.")
else:
    cal = cached_calibration()
    probe = cal.probe_result() if cal is not None else None
    st.dataframe(run_rows(history, probe.matmul_flops_per_s if probe else None), hide_index=True, width="stretch",
                 column_config={"run": st.column_config.TextColumn(pinned=True),  # in view as it scrolls sideways
                                "step (ms)": st.column_config.NumberColumn(format="%.2f")})
    st.caption("Step: mean over the steps after the first, slowest rank. Predicted and error: the planner's "
               "prediction of the run for this machine, and (predicted - measured) / measured. MFU (on this "
               "machine): the model's FLOPs per step over (step time x processes x this machine's calibrated fp32 "
               "matmul rate of one core), so it says how much of each core went into matmuls. Peak MiB / rank: "
               "weights, gradients, optimizer state and the activations' peak on the busiest rank.")
    everything = results_json(history, [command_line(r.cfg) for r in history])
    st.download_button("Download all results (JSON)", everything, file_name="shardlab-lab-results.json",
                       mime="application/json", key="lab_json")
    if len(history) >= 2:
        st.markdown("**Compare two runs**, each at its typical step, on one time axis:")
        names = [r.label for r in history]
        if st.session_state.get("lab_cmp_runs") != len(names):  # a new run: compare the latest two again
            st.session_state["lab_cmp_runs"] = len(names)
            st.session_state["lab_cmp_a"], st.session_state["lab_cmp_b"] = names[-2], names[-1]
        c1, c2 = st.columns(2)
        a = c1.selectbox("First", names, key="lab_cmp_a")
        b = c2.selectbox("Second", names, key="lab_cmp_b")
        run_a, run_b = history[names.index(a)], history[names.index(b)]
        fig_a, fig_b = compare_figures(run_a, run_b)
        st.plotly_chart(fig_a, key="lab_fig_a")
        st.plotly_chart(fig_b, key="lab_fig_b")
        d1, d2 = st.columns(2)
        for col, run, slot in ((d1, run_a, "a"), (d2, run_b, "b")):
            col.download_button(f"Trace of {run.label} (Perfetto)", strict_json(run.timeline.to_chrome_trace()),
                                file_name=f"shardlab-lab-{run.label.replace(' ', '-')}-trace.json",
                                mime="application/json", key=f"lab_trace_{slot}")
