"""The CLI fuzz suite (issue 18): case generators, the judge, and the forking process factory."""
