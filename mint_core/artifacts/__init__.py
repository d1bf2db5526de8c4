"""What a revision is made of on disk and in stores: frozen files, packed shards and their
index, content-addressed stores (local, S3), and the checks that re-export them."""
