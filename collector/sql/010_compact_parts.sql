-- otel_traces writes an insert of up to 128 MiB (uncompressed) as a compact part: one file for every column
-- instead of a file (and marks) per column and Map/Array subcolumn. The collector's groups (20,000-50,000
-- spans, 20-45 MiB) were wide parts of about 100 files each; as compact parts an insert of the ingest
-- benchmark's spans took 8.2 us a row against 9.9 (after the first), and 14.4 against 18.6 for a process's
-- first inserts, fewer files created and written. Merges write wide parts past the bound, as before.
ALTER TABLE otel_traces MODIFY SETTING min_bytes_for_wide_part = 134217728;
