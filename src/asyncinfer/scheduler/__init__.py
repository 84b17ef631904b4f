"""The scheduler: requests, their table rows and KV pages, and the batch each round runs."""
