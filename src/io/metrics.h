// metrics.h: a run's metrics, as JSON lines (OUT_DIR/metrics.jsonl, one object a step, each
// starting {"step": N) and, beside them, as TensorBoard event files
// (OUT_DIR/events.out.tfevents.*): every number of a line becomes the scalar PREFIX/KEY at
// that step (a number inside an object member PREFIX/KEY/ITS_KEY), so `tensorboard --logdir
// OUT_DIR` plots what metrics.jsonl holds.
//
// Event files are TFRecords (a little-endian u64 length, its masked CRC-32C, the bytes, their
// masked CRC-32C) of tensorflow.Event protos: the first holds file_version "brain.Event:2",
// the others a Summary of simple_value scalars. lowbit writes the few protobuf fields itself.
#ifndef LB_METRICS_H
#define LB_METRICS_H

#include <stddef.h>
#include <stdint.h>

typedef struct lb_metrics lb_metrics;

// Opens OUT_DIR/FILE to append and a new event file in OUT_DIR; tags are PREFIX/KEY.
// resume_step < 0: a new run, FILE emptied. Otherwise FILE's rows of steps after resume_step
// are dropped first (the run went past its last checkpoint before it stopped and repeats those
// steps), so every step keeps one row; the kept rows are written atomically. NULL with a
// message in err.
lb_metrics *lb_metrics_open(const char *out_dir, const char *file, const char *prefix,
                            long resume_step, char *err, size_t errlen);
// One JSON line (printf format, no newline): appended to FILE and its numbers to the event
// file, both flushed.
void lb_metrics_printf(lb_metrics *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// TEXT as the text summary PREFIX/KEY at step in the event file alone, shown as it is
// (TensorBoard's Text tab; each line indented as a Markdown code block); metrics.jsonl is not
// touched. The run's resolved configuration goes there.
void lb_metrics_text(lb_metrics *m, int64_t step, const char *key, const char *text);
void lb_metrics_close(lb_metrics *m);

// CRC-32C (Castagnoli) of n bytes, and TFRecord's masked form of it (exposed for tests).
uint32_t lb_crc32c(const void *data, size_t n);
uint32_t lb_crc32c_masked(const void *data, size_t n);

#endif
