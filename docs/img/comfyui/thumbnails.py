"""Template-browser thumbnails of the example workflows: ``example_workflows/<stem>.jpg`` beside each ``<stem>.json``.

ComfyUI's template browser (frontend 1.47) shows a custom-node template with the thumbnail
``/api/workflow_templates/<pack>/<stem>.jpg``, which ComfyUI serves from ``example_workflows/``. Each
thumbnail is a 512x512 card: the workflow's title over the rCM part of its editor screenshot (the PNGs in
this folder, made by ``screenshots.py``).

    python docs/img/comfyui/thumbnails.py
"""

import os

from PIL import Image, ImageDraw, ImageFont

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
# workflow stem -> (screenshot, subtitle, left edge of the crop as a fraction of the screenshot width)
CARDS = {
    "1. Wan 2.1 T2V in 4 rCM steps": ("wan21_t2v_rcm_4step.png", "rCM LoRA  ·  4 steps  ·  no CFG", 0.25),
    "2. Wan 2.2 I2V A14B, two experts, 4 rCM steps": (
        "wan22_i2v_two_expert_rcm.png",
        "high- and low-noise experts  ·  expert split",
        0.22,
    ),
    "3. FLUX.1 dev in 4 rCM steps": ("flux1_dev_rcm_4step.png", "rCM LoRA  ·  4 steps  ·  1024x1024", 0.25),
    "4. Wan 2.1 T2V teacher (50 steps) vs rCM student (4 steps)": (
        "wan21_t2v_teacher_vs_rcm_student.png",
        "same prompt and seed, two videos",
        0.25,
    ),
}
SIZE, BAND = 512, 120


def font(size):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def card(stem, shot, subtitle, left):
    img = Image.new("RGB", (SIZE, SIZE), (24, 26, 38))
    with Image.open(os.path.join(HERE, shot)) as s:
        s = s.convert("RGB")
        h = s.height
        w = int(h * SIZE / (SIZE - BAND))
        x0 = min(int(left * s.width), s.width - w)
        crop = s.crop((x0, 0, x0 + w, h)).resize((SIZE, SIZE - BAND), Image.LANCZOS)
    img.paste(crop, (0, BAND))
    d = ImageDraw.Draw(img)
    title = stem.split(". ", 1)[1]
    words, lines = title.split(), [""]
    for word in words:  # wrap the title into lines that fit
        trial = (lines[-1] + " " + word).strip()
        if d.textlength(trial, font=font(34)) <= SIZE - 32:
            lines[-1] = trial
        else:
            lines.append(word)
    y = 14
    for line in lines[:2]:
        d.text((16, y), line, fill=(255, 255, 255), font=font(34))
        y += 40
    d.text((16, y + 2), subtitle, fill=(255, 196, 64), font=font(22))
    img.save(os.path.join(REPO, "example_workflows", f"{stem}.jpg"), quality=85, optimize=True)


if __name__ == "__main__":
    for stem, (shot, subtitle, left) in CARDS.items():
        card(stem, shot, subtitle, left)
        print(f"example_workflows/{stem}.jpg")
