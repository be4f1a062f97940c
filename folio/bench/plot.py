"""Charts of a serving benchmark, drawn to one PNG: the latency distributions a summary hides (TTFT, ITL), how
latency moved over the run, and output throughput over time next to the requests in flight.

matplotlib is a development dependency, imported only here, so the engine and the other benchmarks do not
need it.
"""

from __future__ import annotations

import numpy as np

from folio.bench.serve_result import ServeResult


def _token_times(result: ServeResult) -> tuple[np.ndarray, np.ndarray]:
    """Arrival time of every text chunk (seconds into the run) and the tokens it stands for, spreading each
    request's output tokens evenly over its chunks (a chunk usually carries one token)."""
    times, weights = [], []
    for r in result.requests:
        if not r.ok:
            continue
        chunk_times = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        times.append(chunk_times)
        weights.append(np.full(len(chunk_times), r.output_tokens / len(chunk_times)))
    if not times:
        return np.empty(0), np.empty(0)
    return np.concatenate(times), np.concatenate(weights)


def plot_serve(result: ServeResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    done = [r for r in result.requests if r.ok]
    fig, ((ttft_ax, itl_ax), (lat_ax, tput_ax)) = plt.subplots(2, 2, figsize=(12, 8))
    rate = "inf" if result.request_rate is None else f"{result.request_rate:g}/s"
    fig.suptitle(f"{result.model}: {result.workload}\nrequest rate {rate}, max concurrency "
                 f"{result.max_concurrency or 'none'}, {result.completed}/{result.num_prompts} completed", fontsize=10)

    ttft_ax.hist([r.ttft_s * 1e3 for r in done], bins=30, color="tab:blue")
    ttft_ax.set(title="time to first token", xlabel="ms", ylabel="requests")

    itl_ax.hist([gap * 1e3 for r in done for gap in r.itl_s], bins=50, color="tab:orange")
    if result.tpot:
        itl_ax.axvline(result.tpot.mean * 1e3, color="k", linestyle="--",
                       label=f"mean TPOT {result.tpot.mean * 1e3:.1f} ms")
        itl_ax.legend()
    itl_ax.set(title="inter-token latency", xlabel="ms", ylabel="chunks")

    sent = [r.start_s for r in done]
    lat_ax.scatter(sent, [r.latency_s for r in done], s=8, label="end-to-end")
    lat_ax.scatter(sent, [r.ttft_s for r in done], s=8, label="TTFT")
    lat_ax.set(title="latency by send time", xlabel="sent at (s)", ylabel="s")
    lat_ax.legend()

    times, weights = _token_times(result)
    edges = np.linspace(0.0, max(result.duration_s, 1e-3), 41)
    tokens, _ = np.histogram(times, bins=edges, weights=weights)
    centers = (edges[:-1] + edges[1:]) / 2
    tput_ax.plot(centers, tokens / np.diff(edges), color="tab:green", label="output tokens/s")
    tput_ax.set(title="throughput over time", xlabel="s", ylabel="output tokens/s")
    in_flight = [sum(r.start_s <= t < r.start_s + r.latency_s for r in done) for t in centers]
    flight_ax = tput_ax.twinx()
    flight_ax.step(centers, in_flight, where="mid", color="tab:gray", alpha=0.6, label="requests in flight")
    flight_ax.set_ylabel("requests in flight")
    tput_ax.legend(loc="upper left")
    flight_ax.legend(loc="upper right")

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
