"""Screenshots of the editor graph of each example workflow: headless Chromium over the DevTools protocol.

Usage, with a ComfyUI server running this pack (e.g. ``python main.py --cpu --listen 127.0.0.1``; put
empty files with the workflows' model names into its models folders so no loader is marked missing):

    python docs/img/comfyui/screenshots.py http://127.0.0.1:8188 docs/img/comfyui example_workflows/*.json

Needs ``chromium`` on PATH and ``aiohttp`` (a ComfyUI requirement). Each workflow is handed to the
editor's *Open* file input (as a user opens a file), fitted to the view, and the graph's bounding
box is captured. Settings written to the server first: tutorial done, minimap and side panel
closed, full-quality drawing down to 20 % zoom.
"""

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys

import aiohttp

WIDTH, HEIGHT = 2400, 1250
SETTINGS = {
    "Comfy.TutorialCompleted": True,
    "Comfy.Minimap.Visible": False,
    "Comfy.RightSidePanel.IsOpen": False,
    "LiteGraph.Canvas.LowQualityRenderingZoomThreshold": 0.2,
}
GRAPH_BOX = """(() => { const c = window.app.canvas, ds = c.ds, r = c.canvas.getBoundingClientRect();
  let x0 = 1e9, y0 = 1e9, x1 = -1e9, y1 = -1e9;
  for (const n of c.graph._nodes) { x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - 34);
    x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]); }
  for (const g of c.graph._groups || []) { const b = g._bounding || g.bounding;
    x0 = Math.min(x0, b[0]); y0 = Math.min(y0, b[1]); x1 = Math.max(x1, b[0] + b[2]); y1 = Math.max(y1, b[1] + b[3]); }
  const sx = v => r.left + (v + ds.offset[0]) * ds.scale, sy = v => r.top + (v + ds.offset[1]) * ds.scale;
  return [sx(x0) - 24, sy(y0) - 24, sx(x1) + 24, sy(y1) + 24]; })()"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DevTools:
    def __init__(self, ws):
        self.ws, self.n = ws, 0

    async def call(self, method, **params):
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json()
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def js(self, expr):
        r = await self.call("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(json.dumps(r["exceptionDetails"])[:1000])
        return r["result"].get("value")

    async def open_workflow(self, path):
        doc = await self.call("DOM.getDocument", depth=-1, pierce=True)
        found = await self.call("DOM.querySelectorAll", nodeId=doc["root"]["nodeId"], selector="input[type=file]")
        for node_id in found["nodeIds"]:
            attrs = (await self.call("DOM.getAttributes", nodeId=node_id))["attributes"]
            if "accept" in attrs and ".json" in attrs[attrs.index("accept") + 1]:
                await self.call("DOM.setFileInputFiles", files=[os.path.abspath(path)], nodeId=node_id)
                return
        raise RuntimeError("the editor has no workflow file input")


async def main(url, out_dir, files):
    port = free_port()
    chromium = subprocess.Popen(
        [
            "chromium",
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--remote-debugging-port={port}",
            "--remote-debugging-address=127.0.0.1",
            "--user-data-dir=/tmp/rcm-chromium-profile",
            f"--window-size={WIDTH},{HEIGHT}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/settings", json=SETTINGS) as r:
                assert r.status == 200, await r.text()
            for _ in range(60):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/json") as r:
                        page = next(t for t in await r.json() if t["type"] == "page")
                    break
                except (aiohttp.ClientError, StopIteration):
                    await asyncio.sleep(0.5)
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                dt = DevTools(ws)
                await dt.call(
                    "Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False
                )
                await dt.call("Page.navigate", url=url)
                for _ in range(120):
                    await asyncio.sleep(1)
                    if await dt.js("!!(window.app && window.app.canvas && window.app.canvas.graph)"):
                        break
                await asyncio.sleep(8)  # the editor restores its last workflow after start-up
                for path in files:
                    with open(path) as f:
                        want = sorted(n["type"] for n in json.load(f)["nodes"])
                    await dt.open_workflow(path)
                    await asyncio.sleep(4)
                    got = sorted(await dt.js("window.app.canvas.graph._nodes.map(n => n.type)"))
                    if got != want:
                        raise RuntimeError(f"the editor shows {got}, not {path}")
                    await dt.js(
                        "(async () => { await window.app.extensionManager.command.execute("
                        "'Comfy.Canvas.FitView'); const c = window.app.canvas; c.setDirty(true, true); "
                        "c.draw(true, true); return true; })()"
                    )
                    await asyncio.sleep(2)
                    x0, y0, x1, y1 = await dt.js(GRAPH_BOX)
                    x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, WIDTH), min(y1, HEIGHT)
                    shot = await dt.call(
                        "Page.captureScreenshot",
                        format="png",
                        clip={"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0, "scale": 1},
                    )
                    name = os.path.join(out_dir, os.path.basename(path).replace(".json", ".png"))
                    with open(name, "wb") as f:
                        f.write(base64.b64decode(shot["data"]))
                    print("saved", name, flush=True)
    finally:
        chromium.terminate()
        chromium.wait(10)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3:]))
