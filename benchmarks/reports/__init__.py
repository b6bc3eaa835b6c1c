"""The reports: a run's phases turned into figures, tables, the targets and a chart."""
