"""The words of the decisions: the only place where ids and numbers become sentences (issue 37)."""
