// Cooperative, 2x1 clusters.
#include "schedules.h"
namespace block_schedules {
static Register<Schedule<Shape<_128, _128, _128>, Shape<_2, _1, _1>, false>> registered("cooperative_128x128_c2x1");
}  // namespace block_schedules
