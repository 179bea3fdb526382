"""One declaration per node, built into either ComfyUI node API.

ComfyUI loads a custom-node module through ``NODE_CLASS_MAPPINGS`` (the legacy API, every
version) or ``comfy_entrypoint`` (the ``comfy_api.latest`` schema, 2025-07 and later), and
prefers the legacy mapping when a module exports both. The pack therefore exports exactly one:
:func:`v3_nodes` where ``comfy_api.latest`` imports, :func:`legacy_nodes` otherwise. Both are
built from the same :class:`Node` list, so the two cannot drift apart. Nothing here imports
ComfyUI at module level.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable


class Input:
    """A node input: ``kind`` is a ComfyUI type name (INT, FLOAT, STRING, BOOLEAN, COMBO, MODEL, SIGMAS...).

    ``options``: COMBO choices, or a callable read when the schema is built (file lists); ``extra``:
    the widget options as ComfyUI names them (default, min, max, step, round, tooltip, label_on...).
    """

    def __init__(self, kind: str, name: str, optional: bool = False, options=None, **extra):
        self.kind, self.name, self.optional, self.options, self.extra = kind, name, optional, options, extra

    def choices(self) -> list:
        return list(self.options() if callable(self.options) else self.options or [])


@dataclass
class Output:
    kind: str
    name: str | None = None
    tooltip: str | None = None


@dataclass
class Result:
    """What ``execute`` returns when it has text for the user besides its outputs (a plain tuple: no text). The
    ``text`` lines are shown on the node in the editor, as ComfyUI's progress text (``PromptServer.send_progress_text``,
    which the frontend draws under the node's widgets; built-in nodes such as GetImageSize use it), and kept as the
    node's UI output ``{"text": [...]}``, which ``/history`` returns to API clients."""

    outputs: tuple
    text: tuple[str, ...] = ()


@dataclass
class Node:
    node_id: str
    display_name: str
    category: str
    description: str
    inputs: list[Input]
    outputs: list[Output]
    execute: Callable[..., tuple | Result]  # widget and link values by input name -> tuple of outputs (or a Result)
    # validate(cls, <widget names>=None) -> True or an error message; ComfyUI calls it on queueing
    validate: Callable[..., Any] | None = None
    # execute may return a Result with text: the node then takes ComfyUI's hidden UNIQUE_ID, to address that text
    shows_text: bool = False


def show_text(text, node_id) -> None:
    """``text`` (lines) on node ``node_id`` in the editor, through the running server's ``send_progress_text``;
    nothing outside a ComfyUI server (tests, scripts), for an unknown node id or a ComfyUI without the call."""
    server = getattr(sys.modules.get("server"), "PromptServer", None)  # ComfyUI's server module, already imported
    send = getattr(getattr(server, "instance", None), "send_progress_text", None)
    if text and node_id is not None and send is not None:
        send("\n".join(text), str(node_id))


def _validate_classmethod(node: Node):
    # ComfyUI reads the argument names of the validate function (inspect.getfullargspec): those inputs
    # it hands over and no longer range-checks itself, so the function keeps the real widget names.
    return classmethod(node.validate)


# ----------------------------------------------------------------------------- comfy_api.latest (V3)


def v3_nodes(nodes: list[Node]) -> list[type]:
    """``io.ComfyNode`` subclasses for ComfyUI versions with ``comfy_api.latest``."""
    from comfy_api.latest import io

    def v3_input(inp: Input):
        kw = dict(inp.extra)
        if inp.optional:
            kw["optional"] = True
        if inp.kind == "COMBO":
            return io.Combo.Input(inp.name, options=inp.choices(), **kw)
        cls = {
            "INT": io.Int,
            "FLOAT": io.Float,
            "STRING": io.String,
            "BOOLEAN": io.Boolean,
            "MODEL": io.Model,
            "SIGMAS": io.Sigmas,
            "SAMPLER": io.Sampler,
        }[inp.kind]
        return cls.Input(inp.name, **kw)

    def v3_output(out: Output):
        cls = {"SIGMAS": io.Sigmas, "SAMPLER": io.Sampler, "MODEL": io.Model}[out.kind]
        kw = {"tooltip": out.tooltip} if out.tooltip else {}
        return cls.Output(display_name=out.name, **kw) if out.name else cls.Output(**kw)

    classes = []
    for node in nodes:

        def define_schema(cls, node=node):
            return io.Schema(
                node_id=node.node_id,
                display_name=node.display_name,
                category=node.category,
                description=node.description,
                inputs=[v3_input(i) for i in node.inputs],
                outputs=[v3_output(o) for o in node.outputs],
                **({"hidden": [io.Hidden.unique_id]} if node.shows_text else {}),
            )

        def execute(cls, node=node, **kwargs):
            r = node.execute(**kwargs)
            if isinstance(r, Result):
                show_text(r.text, getattr(getattr(cls, "hidden", None), "unique_id", None))
                return io.NodeOutput(*r.outputs, ui={"text": list(r.text)} if r.text else None)
            return io.NodeOutput(*r)

        body = {
            "define_schema": classmethod(define_schema),
            "execute": classmethod(execute),
            "__doc__": node.description,
        }
        if node.validate is not None:
            body["validate_inputs"] = _validate_classmethod(node)
        classes.append(type(node.node_id, (io.ComfyNode,), body))
    return classes


# ----------------------------------------------------------------------------- legacy NODE_CLASS_MAPPINGS


def legacy_nodes(nodes: list[Node]) -> tuple[dict[str, type], dict[str, str]]:
    """``(NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)`` for ComfyUI versions without ``comfy_api.latest``."""

    def legacy_input(inp: Input):
        kw = {k: v for k, v in inp.extra.items()}
        if inp.kind == "COMBO":
            return (inp.choices(), kw) if kw else (inp.choices(),)
        return (inp.kind, kw) if kw else (inp.kind,)

    mappings, names = {}, {}
    for node in nodes:

        def input_types(cls, node=node):
            req = {i.name: legacy_input(i) for i in node.inputs if not i.optional}
            opt = {i.name: legacy_input(i) for i in node.inputs if i.optional}
            return {
                "required": req,
                **({"optional": opt} if opt else {}),
                **({"hidden": {"unique_id": "UNIQUE_ID"}} if node.shows_text else {}),
            }

        def run(self, node=node, unique_id=None, **kwargs):
            r = node.execute(**kwargs)
            if isinstance(r, Result):
                show_text(r.text, unique_id)
                return {"ui": {"text": list(r.text)}, "result": tuple(r.outputs)} if r.text else tuple(r.outputs)
            return tuple(r)

        body = {
            "INPUT_TYPES": classmethod(input_types),
            "RETURN_TYPES": tuple(o.kind for o in node.outputs),
            "RETURN_NAMES": tuple(o.name or o.kind for o in node.outputs),
            "OUTPUT_TOOLTIPS": tuple(o.tooltip or "" for o in node.outputs),
            "FUNCTION": "run",
            "run": run,
            "CATEGORY": node.category,
            "DESCRIPTION": node.description,
            "__doc__": node.description,
        }
        if node.validate is not None:
            body["VALIDATE_INPUTS"] = _validate_classmethod(node)
        mappings[node.node_id] = type(node.node_id, (), body)
        names[node.node_id] = node.display_name
    return mappings, names
