// commands.h: the lowbit commands, each run on every rank after the configuration is loaded.
#ifndef LB_COMMANDS_H
#define LB_COMMANDS_H

#include "parallel/comm.h"
#include "src/cli/config.h"

int lb_cmd_train(const lb_config *c, lb_comm *comm);
int lb_cmd_info(const lb_config *c, lb_comm *comm);
int lb_cmd_data(const lb_config *c, lb_comm *comm);
int lb_cmd_data_tokenize(const lb_config *c, lb_comm *comm);   // src/cli/tokenize_cmd.c
int lb_cmd_convert(const lb_config *c, lb_comm *comm);
int lb_cmd_sample(const lb_config *c, lb_comm *comm);   // src/rl/sample_cmd.c
int lb_cmd_rl(const lb_config *c, lb_comm *comm);       // src/rl/rl.c
int lb_cmd_bench(const lb_config *c, lb_comm *comm);

#endif
