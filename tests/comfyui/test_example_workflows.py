"""``example_workflows/``: editor (UI) workflows that ComfyUI lists in its template browser for the pack.

Without ComfyUI: the graph is consistent (links on both ends, types agree) and the rCM nodes' widget
values fit their declarations. With ComfyUI (``COMFYUI_PATH``): every node against the running
server's ``/object_info``, and ``/prompt`` accepts each workflow except for the model files, which
the test machine does not have. The widget order follows ComfyUI's frontend (widgets in definition
order, a seed's ``control_after_generate`` value after it).
"""

import copy
import glob
import json
import os

import pytest
from workflow_format import FILE_INPUTS, check_ui_workflow, object_info_of_pack, ui_to_api

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKFLOWS = sorted(glob.glob(os.path.join(REPO, "example_workflows", "*.json")))
NAMES = [os.path.basename(p) for p in WORKFLOWS]
RCM_NODES = {"RCMSigmas", "RCMSampler", "TrigFlowTeacherSigmas", "RCMLoraLoader", "RCMExpertSplit"}


def load(name):
    with open(os.path.join(REPO, "example_workflows", name)) as f:
        return json.load(f)


TWO_EXPERTS = "2. Wan 2.2 I2V A14B, two experts, 4 rCM steps.json"


def test_the_four_example_workflows_are_there():
    assert NAMES == [
        "1. Wan 2.1 T2V in 4 rCM steps.json",
        TWO_EXPERTS,
        "3. FLUX.1 dev in 4 rCM steps.json",
        "4. Wan 2.1 T2V teacher (50 steps) vs rCM student (4 steps).json",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_template_browser_shows_a_title_an_order_and_a_thumbnail(name):
    """What ComfyUI's template browser shows for a custom-node template (server ``/workflow_templates``: the file
    stems; frontend 1.47 ``workflowTemplatesStore``: title = stem, description = stem with - and _ as spaces,
    thumbnail ``<stem>.jpg`` beside the json, "Alphabetical" sorts by title): a readable stem that starts with its
    place in the list, and a JPEG card beside it."""
    import re

    from PIL import Image

    stem = name[: -len(".json")]
    m = re.fullmatch(r"(\d)\. (\S.*)", stem)
    assert m and int(m[1]) == NAMES.index(name) + 1, stem  # 1., 2., ... in the order of the docs
    title = m[2]
    assert not re.search(r"[-_]", title) and "rCM" in title and len(title) <= 60, title  # shown as is
    thumb = os.path.join(REPO, "example_workflows", stem + ".jpg")
    with Image.open(thumb) as im:
        assert im.format == "JPEG" and im.size == (512, 512)
        # a card, not a gradient placeholder: the title band is dark, the screenshot below has node detail
        px = im.convert("L")
        assert max(px.crop((0, 120, 512, 512)).getextrema()) > 200 and px.crop((0, 120, 512, 512)).getextrema()[0] < 40
    # nothing else in the folder: ComfyUI lists every *.json there as a template
    assert sorted(os.listdir(os.path.join(REPO, "example_workflows"))) == sorted(
        n[:-5] + ext for n in NAMES for ext in (".json", ".jpg")
    )


@pytest.mark.parametrize("name", NAMES)
def test_example_workflow_is_editor_format_and_fits_rcm_nodes(name):
    ui = load(name)
    assert ui["version"] == 0.4 and {"nodes", "links", "last_node_id", "last_link_id"} <= set(ui)
    for node in ui["nodes"]:
        assert len(node["pos"]) == 2 and len(node["size"]) == 2 and node["mode"] == 0, node["id"]
    info = object_info_of_pack()
    assert check_ui_workflow(ui, info, only=RCM_NODES) == []
    assert RCM_NODES & {n["type"] for n in ui["nodes"]}
    # the checker itself: an out-of-range widget, a missing link and a wrong link type are caught
    bad = copy.deepcopy(ui)
    sig = next(n for n in bad["nodes"] if n["type"] in ("RCMSigmas", "RCMSampler"))
    if sig["type"] == "RCMSigmas":
        sig["widgets_values"][0] = 99
        assert any("steps=99 outside" in p for p in check_ui_workflow(bad, info, only=RCM_NODES))
    # the rCM sampler calls the model at the bf16 time official rCM checkpoints and training/rcm.py train with
    for node in (n for n in ui["nodes"] if n["type"] == "RCMSampler"):
        assert node["widgets_values"] == [True, "bf16"], node["id"]
        bad = copy.deepcopy(ui)
        next(n for n in bad["nodes"] if n["id"] == node["id"])["widgets_values"][1] = "fp16"
        problems = check_ui_workflow(bad, info, only=RCM_NODES)
        assert any("time_input='fp16' not in ['bf16', 'float']" in p for p in problems)
        bad["nodes"] = [dict(n, widgets_values=[True]) if n["id"] == node["id"] else n for n in bad["nodes"]]
        assert any("1 widget values for 2 widgets" in p for p in check_ui_workflow(bad, info, only=RCM_NODES))
    bad = copy.deepcopy(ui)
    bad["links"][0][5] = "IMAGE"
    assert any("link says IMAGE" in p for p in check_ui_workflow(bad, info, only=RCM_NODES))


def test_wan22_workflow_splits_at_the_i2v_boundary_and_chains_without_noise():
    ui = load(TWO_EXPERTS)
    api = ui_to_api(ui, object_info_of_pack() | _builtin_stub(ui))
    kinds = {k: v["class_type"] for k, v in api.items()}
    split = next(v for v in api.values() if v["class_type"] == "RCMExpertSplit")
    sigmas = next(v for v in api.values() if v["class_type"] == "RCMSigmas")
    assert split["inputs"]["boundary"] == 0.9 and sigmas["inputs"]["sigma_max"] == 200.0
    samplers = [v for v in api.values() if v["class_type"] == "SamplerCustomAdvanced"]
    assert sorted(s["inputs"]["sigmas"][1] for s in samplers) == [0, 1]  # high, then low
    low = next(s for s in samplers if s["inputs"]["sigmas"][1] == 1)
    assert kinds[low["inputs"]["noise"][0]] == "DisableNoise"


def _builtin_stub(ui):
    """Socket-only stand-ins for built-in nodes: no widgets checked, enough for ui_to_api's link walk."""
    out = {}
    for node in ui["nodes"]:
        if node["type"] not in RCM_NODES:
            out[node["type"]] = {"input": {"required": {}}, "input_order": {"required": []}, "output": []}
    return out


# ----------------------------------------------------------------------------- against a running ComfyUI


def test_example_workflows_against_the_server(comfy_server):
    from comfyui_harness import has_comfy_api_latest

    info = comfy_server.get("/object_info")
    assert RCM_NODES <= set(info), "the pack did not load through the repository-root __init__.py"
    # the editor's template browser lists them under the pack's folder name and serves the files
    templates = comfy_server.get("/workflow_templates")
    assert sorted(templates["rcm-diffusers"]) == [n[:-5] for n in NAMES], templates
    import urllib.parse
    import urllib.request

    for name in NAMES:  # the json and the thumbnail the frontend asks for: /api/workflow_templates/<pack>/<stem>.jpg
        base = comfy_server.url + "/api/workflow_templates/rcm-diffusers/" + urllib.parse.quote(name[:-5])
        with urllib.request.urlopen(base + ".json", timeout=30) as r:
            assert json.loads(r.read()) == load(name)
        with (
            urllib.request.urlopen(base + ".jpg", timeout=30) as r,
            open(os.path.join(REPO, "example_workflows", name[:-5] + ".jpg"), "rb") as f,
        ):
            assert r.read() == f.read()
    if not has_comfy_api_latest(comfy_server.comfy_path):
        # the workflows are saved from a current ComfyUI (e.g. CreateVideo's bit_depth widget is newer);
        # an old one is checked for the rCM nodes only
        for name in NAMES:
            assert check_ui_workflow(load(name), info, only=RCM_NODES) == [], name
        return
    for name in NAMES:
        ui = load(name)
        assert check_ui_workflow(ui, info) == [], name
        status, body = comfy_server.post("/prompt", {"prompt": ui_to_api(ui, info)})
        # the server accepts everything but the model files that are not on this machine
        assert status == 400, (name, body)
        for node_id, errs in body["node_errors"].items():
            for err in errs["errors"]:
                field = err.get("extra_info", {}).get("input_name")
                assert field in FILE_INPUTS and err["type"] in ("value_not_in_list", "custom_validation_failed"), (
                    name,
                    node_id,
                    err,
                )
