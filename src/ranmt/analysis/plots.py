"""The papers' figures as PNG files (matplotlib, Agg backend), one figure per quantity with
every analysed system drawn in it (comparison mode)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

TITLES = {"encoder_self": "encoder self-attention", "decoder_self": "decoder self-attention",
          "cross": "cross-attention"}


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def _entropy(result: dict, out: Path) -> str:
    """Paper 000 Fig. 4: entropy per layer."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, name in zip(axes, TITLES):
        for system in result["systems"]:
            values = system["attention"][name]["entropy"]
            layers = [i + 1 for i, v in enumerate(values) if v is not None]
            ax.plot(layers, [v for v in values if v is not None], marker="o",
                    label=system["label"])
        ax.set_title(TITLES[name])
        ax.set_xlabel("layer")
        ax.set_ylabel("entropy (nats)")
    axes[0].legend()
    return _save(fig, out / "entropy.png")


def _histograms(result: dict, out: Path) -> str:
    """Paper 000 Fig. 5: histograms of attention weights, first / middle / last layer."""
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for row, name in enumerate(("encoder_self", "decoder_self")):
        layers = result["systems"][0]["attention"][name]["layers"]
        chosen = sorted({0, layers // 2, layers - 1})
        if result.get("histogram_layers"):
            chosen = sorted({min(max(layer - 1, 0), layers - 1)
                             for layer in result["histogram_layers"]})[:3]
        for col in range(3):
            ax = axes[row][col]
            if col >= len(chosen):
                ax.axis("off")
                continue
            layer = chosen[col]
            for system in result["systems"]:
                stats = system["attention"][name]
                if layer >= len(stats["histogram"]) or stats["histogram"][layer] is None:
                    continue
                bins = np.array(stats["histogram_bins"])
                ax.step(bins[:-1], stats["histogram"][layer], where="post",
                        label=system["label"])
            ax.set_yscale("log")
            ax.set_title(f"{'Enc' if row == 0 else 'Dec'} L{layer + 1}")
            ax.set_xlabel("attention weight")
    axes[0][0].set_ylabel("share of weights")
    axes[1][0].set_ylabel("share of weights")
    axes[0][0].legend()
    return _save(fig, out / "histograms.png")


def _js(result: dict, out: Path) -> str:
    """Paper 000 Fig. 7: JS divergence between every pair of layers (dark = similar)."""
    systems = result["systems"]
    fig, axes = plt.subplots(len(systems), 3, figsize=(10, 3.2 * len(systems)), squeeze=False)
    for row, system in enumerate(systems):
        for col, name in enumerate(TITLES):
            matrix = np.array([[np.nan if v is None else v for v in line]
                               for line in system["attention"][name]["js_divergence"]])
            ax = axes[row][col]
            image = ax.imshow(matrix, cmap="Blues_r", vmin=0, vmax=np.log(2))
            ax.set_title(f"{system['label']}: {TITLES[name]}", fontsize=9)
            ticks = range(matrix.shape[0])
            ax.set_xticks(ticks, [str(i + 1) for i in ticks])
            ax.set_yticks(ticks, [str(i + 1) for i in ticks])
            fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(fig, out / "js_divergence.png")


def _argmax_distance(result: dict, out: Path) -> str:
    """Paper 004 Fig. 2: per head of each layer, mean |argmax - query position|."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.4))
    for ax, name in zip(axes, ("encoder_self", "decoder_self")):
        for system in result["systems"]:
            per_layer = system["attention"][name]["argmax_distance_per_head"]
            xs, ys = [], []
            for layer, heads in enumerate(per_layer):
                if heads is None:
                    continue
                for head, value in enumerate(heads):
                    xs.append(f"L{layer + 1}H{head + 1}")
                    ys.append(value)
            ax.plot(xs, ys, marker="o", linestyle="", label=system["label"])
        ax.set_title(TITLES[name])
        ax.set_ylabel("mean distance to argmax")
        ax.tick_params(axis="x", rotation=90, labelsize=7)
    axes[0].legend()
    return _save(fig, out / "argmax_distance.png")


def _bins(result: dict, out: Path, key: str, title: str, filename: str) -> str | None:
    if not all(key in s for s in result["systems"]):
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(result["systems"])
    labels = [row["bin"] for row in result["systems"][0][key]]
    for index, system in enumerate(result["systems"]):
        values = [np.nan if row["bleu"] is None else row["bleu"] for row in system[key]]
        ax.bar(np.arange(len(labels)) + index * width, values, width, label=system["label"])
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels)
    ax.set_ylabel("BLEU")
    ax.set_title(title)
    ax.legend()
    return _save(fig, out / filename)


def _heatmaps(system: dict, out: Path) -> list[str]:
    """Paper 000 Fig. 6: learned matrices per layer, head average and per head."""
    written = []
    for name, layers in system["learned_matrices"].items():
        matrices = np.array(layers)  # (L, H, n, n)
        count, heads = matrices.shape[0], matrices.shape[1]
        fig, axes = plt.subplots(1, count, figsize=(3.2 * count, 3.2), squeeze=False)
        for layer in range(count):
            axes[0][layer].imshow(matrices[layer].mean(0), cmap="viridis")
            axes[0][layer].set_title(f"{system['label']} {name} L{layer + 1}", fontsize=8)
        written.append(_save(fig, out / f"heatmap_{system['label']}_{name}.png"))
        fig, axes = plt.subplots(count, heads, figsize=(2.4 * heads, 2.4 * count),
                                 squeeze=False)
        for layer in range(count):
            for head in range(heads):
                axes[layer][head].imshow(matrices[layer, head], cmap="viridis")
                axes[layer][head].set_title(f"L{layer + 1} H{head + 1}", fontsize=7)
                axes[layer][head].axis("off")
        written.append(_save(fig, out / f"heatmap_{system['label']}_{name}_heads.png"))
    return written


def write_figures(result: dict, out: Path) -> list[str]:
    """Write every figure for the analysed systems; return the file names."""
    out = Path(out)
    figures = [_entropy(result, out), _histograms(result, out), _js(result, out),
               _argmax_distance(result, out)]
    for key, title, filename in (
            ("bleu_by_source_length", "BLEU by source length (words)", "bleu_by_source_length.png"),
            ("bleu_by_reference_length", "BLEU by reference length (words)",
             "bleu_by_reference_length.png"),
            ("bleu_by_offdiagonality", "BLEU by decoder off-diagonality",
             "bleu_by_offdiagonality.png")):
        written = _bins(result, out, key, title, filename)
        if written:
            figures.append(written)
    for system in result["systems"]:
        figures.extend(_heatmaps(system, out))
    return figures
