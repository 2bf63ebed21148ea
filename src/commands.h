// commands.h: the lowbit commands, each run on every rank after the configuration is loaded.
#ifndef LB_COMMANDS_H
#define LB_COMMANDS_H

#include "parallel/comm.h"
#include "src/config.h"

// The backend named by run.backend; NULL after printing why.
lb_backend *lb_backend_open(const lb_config *c);
// A setup step that may fail on some ranks only (src/train.c): every rank learns whether any
// failed, so all stop together with one message ("WHO: err", from rank 0 when it failed).
// Collective over w. Returns whether any rank failed.
int lb_any_failed(lb_comm *w, int failed, const char *who, const char *err);

int lb_cmd_train(const lb_config *c, lb_comm *comm);
int lb_cmd_info(const lb_config *c, lb_comm *comm);
int lb_cmd_data(const lb_config *c, lb_comm *comm);
int lb_cmd_convert(const lb_config *c, lb_comm *comm);
int lb_cmd_sample(const lb_config *c, lb_comm *comm);   // src/sample_cmd.c
int lb_cmd_rl(const lb_config *c, lb_comm *comm);       // src/rl.c
int lb_cmd_bench(const lb_config *c, lb_comm *comm);

#endif
