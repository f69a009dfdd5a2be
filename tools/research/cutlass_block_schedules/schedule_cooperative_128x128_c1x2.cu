// te_jax's schedule (BlockCooperative).
#include "schedules.h"
namespace block_schedules {
static Register<Schedule<Shape<_128, _128, _128>, Shape<_1, _2, _1>, false>> registered("cooperative_128x128_c1x2");
}  // namespace block_schedules
