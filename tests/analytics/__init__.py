"""Run analytics: tables, comparison, stragglers, the HTML report, the StepTimer."""
