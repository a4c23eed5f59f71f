"""What a user sees in a saved matplotlib figure: the texts drawn, where they are, and how large, at the saved dpi.

``capture_saved_figures(monkeypatch)`` keeps every figure the code under test saves (``Figure.savefig``), so a test
can read back the drawn figure: its axes' limits and tick labels, and each text's window extent in pixels. The
figures are drawn again at the dpi they were created with, which is the dpi the plotting code saves them at.
"""

from __future__ import annotations

from typing import Any


def capture_saved_figures(monkeypatch) -> list[tuple[Any, float]]:
    """From now on in the test, every ``Figure.savefig`` also appends ``(figure, dpi it was saved at)`` to the list
    returned. The figure stays readable after the code closes it (``plt.close`` only forgets it)."""
    from matplotlib.figure import Figure

    saved: list[tuple[Any, float]] = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append((self, kwargs.get("dpi") or self.dpi))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def drawn_tick_labels(axis, which: str = "y") -> list[tuple[float, Any]]:
    """(value, label) of each non-empty tick label ``axis`` drew along ``which`` ("x" or "y"), major and minor,
    inside its view limits, lowest first."""
    side = axis.yaxis if which == "y" else axis.xaxis
    low, high = sorted(side.get_view_interval())
    tolerance = 1e-9 * max(abs(low), abs(high), 1.0)
    found = []
    for minor in (False, True):
        for value, label in zip(side.get_ticklocs(minor=minor), side.get_ticklabels(minor=minor)):
            if label.get_visible() and label.get_text().strip() and low - tolerance <= value <= high + tolerance:
                found.append((float(value), label))
    return sorted(found, key=lambda pair: pair[0])


def drawn_texts(figure) -> list[Any]:
    """Every non-empty text the figure drew: its title and suptitle, each axes' title, axis labels, offset texts,
    tick labels in view (drawn_tick_labels) and legend entries."""
    texts = [text for text in figure.texts if text.get_visible() and text.get_text().strip()]
    for axes in figure.axes:
        if not axes.get_visible():
            continue
        own = [axes.title, axes.xaxis.label, axes.yaxis.label, axes.xaxis.offsetText, axes.yaxis.offsetText]
        legend = axes.get_legend()
        own += list(legend.get_texts()) if legend is not None else []
        texts += [text for text in own if text.get_visible() and text.get_text().strip()]
        texts += [label for which in ("x", "y") for _, label in drawn_tick_labels(axes, which)]
    return texts


def overlapping_texts(figure, slack: float = 0.5) -> list[tuple[str, str]]:
    """Pairs of drawn texts (drawn_texts) whose boxes on the canvas overlap by more than ``slack`` pixels both ways,
    and texts reaching more than ``slack`` pixels outside the figure, as (text, other text or "the figure's edge")."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)  # the code under test closed the figure: draw it again, as it was saved
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [(text.get_text(), text.get_window_extent(renderer)) for text in drawn_texts(figure)]
    width, height = figure.bbox.width, figure.bbox.height
    found = []
    for index, (name, box) in enumerate(boxes):
        if box.x0 < -slack or box.y0 < -slack or box.x1 > width + slack or box.y1 > height + slack:
            found.append((name, "the figure's edge"))
        for other, other_box in boxes[index + 1 :]:
            across = min(box.x1, other_box.x1) - max(box.x0, other_box.x0)
            up = min(box.y1, other_box.y1) - max(box.y0, other_box.y0)
            if across > slack and up > slack:
                found.append((name, other))
    return found


def font_pixels(text, dpi: float) -> float:
    """A text's font size in pixels of an image saved at ``dpi``."""
    return text.get_fontsize() * dpi / 72
