"""The digits evaluator: a seeded MLP classifier, Fréchet distance in its hidden features, within-class diversity."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .teacher import CLASSIFIER_PATH, NUM_CLASSES, load_digits_split, to_pixels

# ----------------------------------------------------------------------------- evaluator


class DigitClassifier(nn.Module):
    """MLP ``64 -> 256 -> 64 (features) -> 10`` on flat ``[-1, 1]`` pixels; ``features`` feeds the FD."""

    def __init__(self, hidden: int = 256, feat: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.SiLU(), nn.Linear(hidden, feat), nn.SiLU())
        self.head = nn.Linear(feat, NUM_CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(to_pixels(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def train_classifier(
    x: torch.Tensor, y: torch.Tensor, seed: int = 0, epochs: int = 60, noise_std: float = 0.1
) -> DigitClassifier:
    """Seeded Adam training (batch 64, lr 2e-3, Gaussian pixel noise ``noise_std`` for robustness); a few seconds."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    clf = DigitClassifier()
    opt = torch.optim.Adam(clf.parameters(), lr=2e-3, weight_decay=1e-4)
    xf = to_pixels(x)
    for _ in range(epochs):
        perm = torch.randperm(len(xf), generator=g)
        for i in range(0, len(xf), 64):
            idx = perm[i : i + 64]
            xb = xf[idx] + noise_std * torch.randn(len(idx), 64, generator=g)
            loss = nn.functional.cross_entropy(clf(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return clf.eval()


def load_classifier(path: str = CLASSIFIER_PATH) -> DigitClassifier:
    """The shipped evaluator classifier (``training/train_teacher_digits.py`` writes it)."""
    from safetensors.torch import load_file

    clf = DigitClassifier()
    clf.load_state_dict(load_file(path))
    return clf.eval()


def frechet_distance(f1: np.ndarray, f2: np.ndarray) -> float:
    """``||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2))`` of two feature sets ``[N, d]`` (float64; the trace of
    the matrix root is computed as ``sum sqrt(eig(S1^(1/2) S2 S1^(1/2)))``, which is symmetric PSD)."""
    f1, f2 = np.asarray(f1, np.float64), np.asarray(f2, np.float64)
    mu1, mu2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    w, q = np.linalg.eigh(s1)
    r1 = (q * np.sqrt(np.clip(w, 0, None))) @ q.T
    m = r1 @ s2 @ r1
    tr_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * tr_sqrt)


def within_class_diversity(feats: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per class, the mean pairwise Euclidean distance of its feature vectors (NaN for fewer than 2)."""
    out = np.full(NUM_CLASSES, np.nan)
    for c in range(NUM_CLASSES):
        f = np.asarray(feats, np.float64)[np.asarray(labels) == c]
        if len(f) >= 2:
            d = np.sqrt(((f[:, None] - f[None]) ** 2).sum(-1))
            out[c] = d.sum() / (len(f) * (len(f) - 1))
    return out


class Evaluator:
    """Metrics of generated digits against the held-out split, in the classifier's feature space.

    ``fd``: Fréchet distance to held-out real; ``accuracy``: classifier predicts the conditioned class;
    ``diversity``: mean over classes of (within-class mean pairwise feature distance of samples / of real);
    ``fd_pixel``: Fréchet distance in raw pixels (the 64 clipped ``[-1, 1]`` values), a second feature space that
    owes nothing to the classifier, so that a gain in ``fd`` can be checked not to be an artefact of its features.
    """

    def __init__(
        self,
        classifier: DigitClassifier | None = None,
        x_ref: torch.Tensor | None = None,
        y_ref: torch.Tensor | None = None,
    ):
        if x_ref is None:
            s = load_digits_split()
            x_ref, y_ref = s["x_test"], s["y_test"]
        self.clf = classifier if classifier is not None else load_classifier()
        self.f_ref = self.features(x_ref)
        self.p_ref = self.pixels(x_ref)
        self.y_ref = y_ref.numpy()
        self.div_ref = within_class_diversity(self.f_ref, self.y_ref)

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> np.ndarray:
        return self.clf.features(x.cpu()).double().numpy()

    @staticmethod
    def pixels(x: torch.Tensor) -> np.ndarray:
        return to_pixels(x.cpu()).double().numpy()

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return float((self.clf(x.cpu()).argmax(-1) == y.cpu()).float().mean())

    def fd_to(self, x: torch.Tensor) -> float:
        """FD between samples ``x`` and another set, e.g. the 100-NFE teacher's samples (distillation fidelity)."""
        return frechet_distance(self.features(x), self.f_ref)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        f = self.features(x)
        div = within_class_diversity(f, y.cpu().numpy()) / self.div_ref
        return {
            "fd": frechet_distance(f, self.f_ref),
            "accuracy": self.accuracy(x, y),
            "diversity": float(np.nanmean(div)),
            "fd_pixel": frechet_distance(self.pixels(x), self.p_ref),
        }
