"""The storage hierarchy under offloaded inference and offloaded training: files read and written
directly or through the page cache, and the tiers above them."""
