"""mlx_fill.evidence: evidence tools: corpus study, strict-row audit, replay A/B, reports, demo, recorded transcripts."""
