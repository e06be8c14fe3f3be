! echo_solver.f90: echo_solver.c in Fortran, through the mpirl module: the same observations,
! rewards and flags (see echo_solver.c), each rank computing its block of the observation and
! the group's root gathering them (group_gather.c: the venv's Open MPI has no Fortran MPI).
program echo_solver_f
   use iso_c_binding, only: c_int, c_long, c_double
   use mpirl
   implicit none

   interface
      integer(c_int) function group_gather(comm, block, count, out) bind(C, name="group_gather_f")
         import :: c_int, c_double
         integer(c_int), value :: comm, count
         real(c_double), intent(in) :: block(*)
         real(c_double), intent(out) :: out(*)
      end function
      subroutine group_rank_size(comm, rank, size) bind(C, name="group_rank_size_f")
         import :: c_int
         integer(c_int), value :: comm
         integer(c_int), intent(out) :: rank, size
      end subroutine
   end interface

   type(mpirl_solver) :: s
   integer :: ierr, command, group, rank, k, n_obs, n_act, first, count, i, j, code
   integer(c_long) :: seed, t, episode_length, fail_at
   real(c_double) :: reward
   real(c_double), allocatable :: action(:), block(:), obs(:)
   character(len=64) :: message

   call mpirl_init(s, ierr)
   if (ierr /= 0) then
      call mpirl_finalize(s, code)
      call exit(code)
   end if
   group = mpirl_group_comm(s)
   call group_rank_size(group, rank, k)
   n_obs = mpirl_obs_size(s)
   n_act = mpirl_action_size(s)
   episode_length = mpirl_config_long(s, "episode_length", 0_c_long)
   fail_at = mpirl_config_long(s, "fail_at", 0_c_long)

   ! This rank's block: [first, first + count), 0-based as in echo_solver.c.
   count = n_obs / k
   if (rank < mod(n_obs, k)) count = count + 1
   first = rank * (n_obs / k) + min(rank, mod(n_obs, k))
   allocate(action(n_act), block(count + 1), obs(n_obs + 1))
   t = 0
   do
      call mpirl_next(s, action, seed, command)
      if (command == MPIRL_END) exit
      reward = 0
      if (command == MPIRL_RESET) then
         t = 0
         do j = 1, count
            block(j) = real(max(seed, 0_c_long), c_double) + 0.5d0 * (first + j - 1)
         end do
      else
         t = t + 1
         if (fail_at > 0 .and. t == fail_at) then
            write(message, '(a, i0)') "echo_solver_f: fail_at step ", t
            call mpirl_fail(s, message)
            exit
         end if
         do j = 1, count
            i = first + j - 1
            block(j) = action(mod(i, n_act) + 1) + 1000d0 * t + i
         end do
         reward = real(t, c_double) + sum(action)
      end if
      ierr = group_gather(group, block, count, obs)
      call mpirl_send(s, obs, reward, .false., episode_length > 0 .and. t >= episode_length, ierr)
   end do
   call mpirl_finalize(s, code)
   call exit(code)
end program echo_solver_f
