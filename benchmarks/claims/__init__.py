"""The claim reproductions: each writes the JSON that results/<claim>/ holds."""
