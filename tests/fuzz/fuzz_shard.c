// fuzz_shard.c: token shards: lb_shard_read, and the loader (open: the header; the check of
// every token against a 256-token vocabulary; a few batches).
#include "src/io/data.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[1024] = "";
    const char *path = lb_fuzz_file(data, size, ".bin");
    uint32_t *tok;
    size_t n;
    int rc = lb_shard_read(path, &tok, &n, err, sizeof err);
    if (rc == 0) free(tok);
    lb_loader *l = rc == 0 ? lb_loader_open(path, 1, 4, 256, err, sizeof err) : NULL;
    if (rc == 0 && !l) rc = -1;
    if (l) {
        rc = lb_loader_check_shard(l, 0, err, sizeof err);
        int32_t in[4], tg[4];
        for (int i = 0; i < 3 && rc == 0; i++) {
            rc = lb_loader_next(l, in, tg, err, sizeof err);
            for (int j = 0; rc == 0 && j < 4; j++)
                if (in[j] < 0 || in[j] >= 256 || tg[j] < 0 || tg[j] >= 256) abort();
        }
        lb_loader_close(l);
    }
    if (rc != 0) lb_fuzz_names(err, path);
    lb_fuzz_accepted = rc == 0;
    return 0;
}
