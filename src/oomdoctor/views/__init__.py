"""Views: what the HTML page, the Perfetto tracks and the folded stacks draw of a rank, shaped from its analysis
(timelines, segment maps, flame graphs and their moments, the overlay of two runs, counter tracks). Numbers only;
the renderers (:mod:`oomdoctor.render`) lay them out. Below :mod:`oomdoctor.report`, whose per-rank work
(:mod:`oomdoctor.report.job`) draws them in the process that holds the trace; no verdict depends on them."""
