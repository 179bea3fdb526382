"""Editor (UI) workflows against node definitions, and UI -> API conversion, as ComfyUI's frontend does it.

``object_info`` is what ComfyUI's ``GET /object_info`` returns (or :func:`object_info_of_pack` for
the rCM nodes alone): per node ``input.required/optional`` (name -> [type, options]),
``input_order``, ``output``. In a UI workflow, ``widgets_values`` holds the node's widget inputs in
definition order, an INT seed with ``control_after_generate`` followed by its control value
("fixed", "randomize", ...); socket inputs are links ``[id, from_node, from_slot, to_node, to_slot, type]``.
"""

from __future__ import annotations

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_NAMES = {"seed", "noise_seed"}
#: combo inputs listing files of the user's models/input folders: not checked against the (empty) test lists
FILE_INPUTS = {"unet_name", "lora_name", "clip_name", "clip_name1", "clip_name2", "vae_name", "image", "ckpt_name"}


def _inputs(info: dict):
    """(name, type, options, required) of a node in definition order."""
    order = info.get("input_order") or {s: list(info["input"].get(s, {})) for s in ("required", "optional")}
    for section in ("required", "optional"):
        for name in order.get(section, []):
            spec = info["input"][section][name]
            kind, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            yield name, kind, opts, section == "required"


def is_widget(kind, opts) -> bool:
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not opts.get("forceInput")


def widget_slots(info: dict) -> list[tuple[str, object, dict] | None]:
    """The entries of ``widgets_values`` in order; None marks a seed's control value."""
    slots = []
    for name, kind, opts, _ in _inputs(info):
        if is_widget(kind, opts):
            slots.append((name, kind, opts))
            if kind == "INT" and (opts.get("control_after_generate") or name in SEED_NAMES):
                slots.append(None)
    return slots


def combo_options(kind, opts) -> list:
    return list(kind) if isinstance(kind, list) else list(opts.get("options", []))


def check_ui_workflow(ui: dict, object_info: dict, only: set[str] | None = None) -> list[str]:
    """Problems of a UI workflow against the node definitions (empty list = fine).

    Checks every link (both ends exist, slot types agree), every required socket input linked,
    ``widgets_values`` of the right length with values of the right type, in range, and in the combo
    list (file-name combos excepted). ``only``: check the nodes of these types only (links always).
    """
    problems = []
    nodes = {n["id"]: n for n in ui["nodes"]}
    for lid, src, src_slot, dst, dst_slot, ltype in ui["links"]:
        if src not in nodes or dst not in nodes:
            problems.append(f"link {lid}: node {src} or {dst} does not exist")
            continue
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        if lid not in (out.get("links") or []) or inp.get("link") != lid:
            problems.append(f"link {lid} is not recorded on both ends")
        if not (out["type"] == inp["type"] == ltype):
            problems.append(f"link {lid}: {out['type']} -> {inp['type']} (link says {ltype})")
    for node in ui["nodes"]:
        kind = node["type"]
        where = f"node {node['id']} ({kind})"
        if kind not in object_info:
            if only is None:
                problems.append(f"{where}: unknown node type")
            continue
        if only is not None and kind not in only:
            continue
        info = object_info[kind]
        sockets = {i["name"]: i for i in node.get("inputs", [])}
        for name, ikind, opts, required in _inputs(info):
            if is_widget(ikind, opts):
                continue
            if name not in sockets:
                problems.append(f"{where}: socket input {name} missing from the node")
            elif required and sockets[name].get("link") is None:
                problems.append(f"{where}: required input {name} is not linked")
            elif sockets[name]["type"] != ikind:
                problems.append(f"{where}: input {name} has type {sockets[name]['type']}, definition {ikind}")
        for i, (out, okind) in enumerate(zip(node.get("outputs", []), info["output"])):
            if out["type"] != okind:
                problems.append(f"{where}: output {i} has type {out['type']}, definition {okind}")
        slots, values = widget_slots(info), node.get("widgets_values", [])
        if len(values) != len(slots):
            problems.append(
                f"{where}: {len(values)} widget values for {len(slots)} widgets {[s and s[0] for s in slots]}"
            )
            continue
        for slot, value in zip(slots, values):
            if slot is None:
                if value not in ("fixed", "increment", "decrement", "randomize"):
                    problems.append(f"{where}: seed control {value!r}")
                continue
            name, wkind, opts = slot
            if wkind in ("INT", "FLOAT"):
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or (wkind == "INT" and value != int(value))
                ):
                    problems.append(f"{where}: {name}={value!r} is not an {wkind}")
                    continue
                if "min" in opts and value < opts["min"] or "max" in opts and value > opts["max"]:
                    problems.append(f"{where}: {name}={value} outside [{opts.get('min')}, {opts.get('max')}]")
            elif wkind == "BOOLEAN" and not isinstance(value, bool):
                problems.append(f"{where}: {name}={value!r} is not a boolean")
            elif wkind == "STRING" and not isinstance(value, str):
                problems.append(f"{where}: {name}={value!r} is not a string")
            elif (isinstance(wkind, list) or wkind == "COMBO") and name not in FILE_INPUTS:
                if value not in combo_options(wkind, opts):
                    problems.append(f"{where}: {name}={value!r} not in {combo_options(wkind, opts)}")
    return problems


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """The API-format prompt of a UI workflow (what the editor POSTs to /prompt when you press Queue)."""
    links = {link[0]: link for link in ui["links"]}
    prompt = {}
    for node in ui["nodes"]:
        if node.get("mode", 0) != 0:  # muted / bypassed
            continue
        info = object_info[node["type"]]
        inputs = {}
        values = iter(node.get("widgets_values", []))
        for slot in widget_slots(info):
            value = next(values)
            if slot is not None:
                inputs[slot[0]] = value
        for sock in node.get("inputs", []):
            if sock.get("link") is not None:
                _, src, src_slot, _, _, _ = links[sock["link"]]
                inputs[sock["name"]] = [str(src), src_slot]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def object_info_of_pack() -> dict:
    """``/object_info`` entries of the rCM nodes, from their declarations (no ComfyUI needed)."""
    from comfy_nodes.nodes import NODES

    info = {}
    for node in NODES:
        sections = {"required": {}, "optional": {}}
        for inp in node.inputs:
            opts = dict(inp.extra)
            kind = inp.kind
            if kind == "COMBO":
                opts["options"] = inp.choices() if not callable(inp.options) else []
            sections["optional" if inp.optional else "required"][inp.name] = [kind, opts]
        info[node.node_id] = {
            "input": sections,
            "input_order": {s: list(v) for s, v in sections.items()},
            "output": [o.kind for o in node.outputs],
        }
    return info
